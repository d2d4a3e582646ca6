// Python module shell for retmask._C. The kernels themselves export a C ABI (see attention_cpu.cpp)
// and are called through ctypes, so this module defines no Python methods.
#include <Python.h>

static struct PyModuleDef retmask_c_module = {
    PyModuleDef_HEAD_INIT, "_C", "retmask fused CPU kernels (C ABI, loaded via ctypes)", -1, nullptr,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&retmask_c_module); }
