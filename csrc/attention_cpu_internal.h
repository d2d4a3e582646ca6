// What the argument checks (attention_cpu.cpp) hand to the per-ISA builds of the kernel
// (attention_cpu_kernel.h): the normalised arguments, and one entry point per build.
#pragma once

#include <cstdint>

#include "attention_cpu.h"

namespace retmask::detail {

struct KernelArgs {
    const void *q, *k, *v;
    const int64_t *qs, *ks, *vs, *os;  // element strides [4]
    void* out;
    int64_t* argmax;                  // [B, Hq, T] contiguous, or null
    const uint8_t* kpm;               // [B, N] contiguous (1 = valid), or null
    const uint8_t* skip;              // [B, Hq] contiguous (1 = skipped), or null
    int64_t B, Hq, Hkv, M, N, D, T;
    bool causal;
    float scale;
    int block_m, block_n;
    int64_t window;  // 1 <= window < N, or 0: no window (window >= N is normalised to 0)
    // Sink tokens: keys j < sink are seen by every row at p >= j besides its window; 1 <= sink < N - window
    // (with a window), or 0: none (sink + window >= N is normalised to no window and no sink).
    int64_t sink;
    // Soft cap c (0: none) and the factors of s / c = (s * cap_inv) * cap_post: cap_post = 1 unless 1 / c
    // overflows (subnormal c), where both are rescaled by 2^64.
    float softcap, cap_inv, cap_post;
    const float* sinks;  // [Hq] fp32, or null
    bool bf16_dot;  // bfloat16, even D: the lanes layout's products as bf16 dot products
    int64_t* visited;  // if not null: += the (row, key) logits computed (AttentionFwdArgs::visited_logits)
};

// The backward (attention_bwd_cpu_kernel.h), normalised: strides in elements, [4] each.
struct BwdKernelArgs {
    const void *q, *k, *v, *dout;
    void *dq, *dk, *dv;
    const int64_t *qs, *ks, *vs, *dos, *dqs, *dks, *dvs;
    const uint8_t* kpm;   // [B, N] contiguous (1 = valid), or null
    const uint8_t* skip;  // [B, Hq] contiguous (1 = skipped), or null
    int64_t B, Hq, Hkv, M, N, D;
    bool causal;
    float scale;
    int64_t block_m;  // query rows per block; 0: sized for the cache
    int64_t window;   // 1 <= window < N (needs causal), or 0: no window
    int64_t sink;     // sink tokens, as in KernelArgs: 1 <= sink < N - window (needs a window), or 0
};

// One build of the kernel per instruction set; attention_cpu.cpp calls the one the CPU runs (x86: the
// AVX-512 (+ BF16) and AVX2 builds exist only on x86, chosen at run time with __builtin_cpu_supports).
namespace avx512bf16 {
void run(const KernelArgs& a, DType dtype, int threads);
void run_bwd(const BwdKernelArgs& a, DType dtype, int threads);
}
namespace avx512 {
void run(const KernelArgs& a, DType dtype, int threads);
void run_bwd(const BwdKernelArgs& a, DType dtype, int threads);
}
namespace avx2 {
void run(const KernelArgs& a, DType dtype, int threads);
void run_bwd(const BwdKernelArgs& a, DType dtype, int threads);
}
namespace generic {
void run(const KernelArgs& a, DType dtype, int threads);
void run_bwd(const BwdKernelArgs& a, DType dtype, int threads);
}

}  // namespace retmask::detail
