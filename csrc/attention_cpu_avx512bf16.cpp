// The avx512bf16 build of the fused CPU attention kernel (attention_cpu_kernel.h) and of the linear kernel
// (linear_cpu_kernel.h): the avx512 build plus
// AVX512-BF16, whose vdpbf16ps runs the bf16dot lanes layout natively (two bf16 multiply-adds per fp32
// lane and instruction); every other path compiles as in the avx512 build. attention_cpu.cpp calls it
// only on CPUs that report AVX-512F and AVX512-BF16.
//
// Every header is included *before* the target pragma, so the standard library's inline functions keep
// the baseline instruction set (immintrin.h declares each intrinsic with its own target).
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

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_cpu_internal.h"
#include "linear_cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2,popcnt")
#define RETMASK_VL 16
#define RETMASK_ISA avx512bf16
#define RETMASK_BF16_DOT 1
#include "attention_cpu_kernel.h"
#include "attention_bwd_cpu_kernel.h"
#include "linear_cpu_kernel.h"
#pragma GCC pop_options
#else
// Not x86: this build does not exist (attention_cpu.cpp never lists it); the symbol keeps the link whole.
namespace retmask::detail::avx512bf16 {
void run(const KernelArgs&, DType, int) {}
void run_bwd(const BwdKernelArgs&, DType, int) {}
void linear_rows(const LinearKernelArgs&, DType, int) {}
}  // namespace retmask::detail::avx512bf16
#endif
