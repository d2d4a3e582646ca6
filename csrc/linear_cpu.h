// The CPU linear kernel for few input rows as its Python binding (module.cpp) calls it: y = x W^T (+ bias)
// with the weight read once, in place. Entry point in attention_cpu.cpp (beside the attention kernel's,
// sharing its choice of build); the per-ISA builds of linear_cpu_kernel.h.
// Plain C++17: no Python and no torch headers.
#pragma once

#include <cstdint>
#include <string>

#include "attention_cpu.h"

namespace retmask {

struct LinearArgs {
    DType dtype = DType::Float32;  // of x, weight, bias and y: Float32 or BFloat16
    const void* x = nullptr;       // [rows, K], unit stride along K, row stride x_stride
    const void* weight = nullptr;  // [N, K], unit stride along K, row stride w_stride
    const void* bias = nullptr;    // [N] contiguous, or null
    void* y = nullptr;             // [rows, N] contiguous
    int64_t rows = 0, N = 0, K = 0;
    int64_t x_stride = 0, w_stride = 0;  // in elements, >= K (a single row's x_stride is not read)
    int num_threads = 0;                 // OpenMP threads for calls large enough to split; <= 0: the default
    std::string isa;                     // which build runs: "" = the widest this CPU has (cpu_builds())
};

// Checks the arguments (std::invalid_argument naming the bad field), then writes every element of y:
// y[r][n] = sum_k x[r][k] * weight[n][k] (+ bias[n]), accumulated in fp32 and, for bfloat16, rounded to
// the nearest even bf16 once. Allocates nothing; touches no Python state (called without the GIL).
void linear_rows_cpu(const LinearArgs& args);

namespace detail {

// What linear_rows_cpu hands to a build, checked: the fields of LinearArgs without the dispatch ones.
struct LinearKernelArgs {
    const void *x, *weight, *bias;
    void* y;
    int64_t rows, N, K, x_stride, w_stride;
};

// One build per instruction set, as for the attention kernel (attention_cpu_internal.h).
namespace avx512bf16 {
void linear_rows(const LinearKernelArgs& a, DType dtype, int threads);
}
namespace avx512 {
void linear_rows(const LinearKernelArgs& a, DType dtype, int threads);
}
namespace avx2 {
void linear_rows(const LinearKernelArgs& a, DType dtype, int threads);
}
namespace generic {
void linear_rows(const LinearKernelArgs& a, DType dtype, int threads);
}

using LinearRowsFn = void (*)(const LinearKernelArgs&, DType, int);

}  // namespace detail
}  // namespace retmask
