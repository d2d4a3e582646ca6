// The avx512 build of the fused CPU attention kernel (attention_cpu_kernel.h) and of the linear kernel
// (linear_cpu_kernel.h): AVX-512 (F, VL, BW, DQ): 16 fp32 lanes per zmm register, 32 registers.
// attention_cpu.cpp calls it only on CPUs that report these features.
//
// Every header is included *before* the target pragma, so the standard library's inline functions keep
// the baseline instruction set: only this file's own (internal) functions are compiled for avx512, and
// no shared inline copy with avx512 instructions can end up called from the other builds.
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
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi,bmi2,popcnt")
#define RETMASK_VL 16
#define RETMASK_ISA avx512
#include "attention_cpu_kernel.h"
#include "attention_bwd_cpu_kernel.h"
#include "linear_cpu_kernel.h"
#pragma GCC pop_options
#else
// Not x86: this build does not exist (attention_cpu.cpp never lists it); the symbol keeps the link whole.
namespace retmask::detail::avx512 {
void run(const KernelArgs&, DType, int) {}
void run_bwd(const BwdKernelArgs&, DType, int) {}
void linear_rows(const LinearKernelArgs&, DType, int) {}
}  // namespace retmask::detail::avx512
#endif
