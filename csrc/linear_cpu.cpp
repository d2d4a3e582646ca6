// Entry point of the CPU linear kernel (linear_cpu.h): checks the arguments, then runs the build of
// linear_cpu_kernel.h for the widest instruction set this CPU has (the choice of attention_cpu.cpp).
//
// Bad arguments are reported as std::invalid_argument naming the field, before any compute.
#include <cstdint>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "linear_cpu.h"

namespace {

[[noreturn]] void bad(const char* field, const std::string& what) {
    throw std::invalid_argument(std::string(field) + ": " + what);
}

std::string str(int64_t x) { return std::to_string(x); }

void check(const retmask::LinearArgs& p) {
    using retmask::DType;
    if (p.dtype != DType::Float32 && p.dtype != DType::BFloat16)
        bad("dtype", "code " + str(static_cast<int>(p.dtype)) + " is not float32 (0) or bfloat16 (2)");
    if (p.rows < 0) bad("rows", str(p.rows) + " input rows, need >= 0");
    if (p.N < 0) bad("N", str(p.N) + " output features, need >= 0");
    if (p.K < 0) bad("K", str(p.K) + " input features, need >= 0");
    if (p.rows > 1 && p.x_stride < p.K) bad("x", "row stride " + str(p.x_stride) + " < K = " + str(p.K));
    if (p.N > 1 && p.w_stride < p.K) bad("weight", "row stride " + str(p.w_stride) + " < K = " + str(p.K));
    if (p.rows > 0 && p.N > 0) {
        if (!p.y) bad("y", "null data pointer");
        if (p.K > 0 && !p.x) bad("x", "null data pointer");
        if (p.K > 0 && !p.weight) bad("weight", "null data pointer");
    }
}

}  // namespace

namespace retmask {

void linear_rows_cpu(const LinearArgs& p) {
    check(p);
    const detail::LinearRowsFn run = detail::linear_rows_build(p.isa);  // an unknown name is an error too
    if (p.rows == 0 || p.N == 0) return;
#ifdef _OPENMP
    const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
#else
    const int threads = 1;
#endif
    run({p.x, p.weight, p.bias, p.y, p.rows, p.N, p.K, p.x_stride, p.w_stride}, p.dtype, threads);
}

}  // namespace retmask
