// The avx2 build of the fused CPU attention kernel (attention_cpu_kernel.h) and of the linear kernel
// (linear_cpu_kernel.h): AVX2 + FMA: 8 fp32 lanes per ymm register, 16 registers.
// attention_cpu.cpp calls it only on CPUs that report these features.
//
// Every header is included *before* the target pragma, so the standard library's inline functions keep
// the baseline instruction set: only this file's own (internal) functions are compiled for avx2, and
// no shared inline copy with avx2 instructions can end up called from the other builds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_cpu_internal.h"
#include "linear_cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,popcnt")
#define RETMASK_VL 8
#define RETMASK_ISA avx2
#include "attention_cpu_kernel.h"
#include "attention_bwd_cpu_kernel.h"
#include "linear_cpu_kernel.h"
#pragma GCC pop_options
#else
// Not x86: this build does not exist (attention_cpu.cpp never lists it); the symbol keeps the link whole.
namespace retmask::detail::avx2 {
void run(const KernelArgs&, DType, int) {}
void run_bwd(const BwdKernelArgs&, DType, int) {}
void linear_rows(const LinearKernelArgs&, DType, int) {}
}  // namespace retmask::detail::avx2
#endif
