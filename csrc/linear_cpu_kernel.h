// The ISA-generic body of the CPU linear kernel for few input rows, compiled once per instruction set
// (included by attention_cpu_{avx512bf16,avx512,avx2,generic}.cpp after the attention kernel, with the same
// RETMASK_VL, RETMASK_ISA and target pragma).
//
// y[r][n] = sum_k x[r][k] * w[n][k] (+ bias[n]). With one input row (a decode step) a linear is a
// matrix-vector product: 2 flops per weight element read, so its time is the time to stream the weight
// from memory, and torch's fp32 sgemv and bf16 inner product reach well under the memory bandwidth on the
// CPUs we measured (bench/RESULTS.md, "fp32 linears"). Here every output is a dot product along K, the
// weight's unit-stride axis, so the weight streams once in its own layout, no copy, no packing:
//
// * WR = 4 weight rows per step, their VL-wide slices multiplied with the same slice of each input row:
//   WR x XRows fp32 accumulators in registers, each reduced to a scalar once at the end of the row (the
//   K % VL tail, if any, added in scalar code).
// * More input rows (a verification pass, a small batch) go through each block of WR weight rows in
//   groups of XR, so the block (WR x K elements, L1/L2-resident) is read from memory once for all rows.
// * Threads split the blocks of weight rows into contiguous ranges (static schedule): each thread streams
//   its own part of the weight; calls too small to pay for a parallel region run on the calling thread.
// * A short last block (N % WR rows) or group (rows % XR) repeats its last row, computed and not stored,
//   so that one code path serves every shape.
// * Rows of at most PREFETCH_ROW_BYTES: each step also prefetches the next block's rows at the same offset.
//   The hardware prefetchers need a few misses per stream to start and stop at 4 KB pages, so a block's 4
//   streams of short rows (576 bf16 are 18 cache lines) ran mostly on demand misses. Measured on Zen 4 with
//   the weights streamed from memory (an A/B of the two builds): SmolLM2's K = 576 layers took 0.79-0.93x
//   the time with it (bf16, 1 and 4 rows; fp32 0.87-1.02x), while 4096-wide fp32 rows took 1.0-1.18x:
//   there the hardware streams run and the extra instructions only cost.
// * bfloat16: in the avx512bf16 build the products of 2 * VL elements run on vdpbf16ps (pairs along K;
//   each product exact, denormal inputs read as zero, as torch's oneDNN bf16 kernels run on that CPU);
//   elsewhere bf16 widens to fp32 exactly and multiplies-adds as fp32. Sums in fp32, the result (plus the
//   bias) rounded to the nearest even bf16 once.
//
// Everything here has internal linkage except linear_rows, the build's entry point (linear_cpu.h).
#include "linear_cpu.h"

#ifndef RETMASK_VL
#error "define RETMASK_VL (8 or 16) and RETMASK_ISA before including linear_cpu_kernel.h"
#endif

namespace retmask::detail::RETMASK_ISA {
namespace linear_kernel {
namespace {

constexpr int VL = RETMASK_VL;
constexpr int WR = 4;                  // weight rows per step
constexpr int XR = VL == 16 ? 4 : 2;   // input rows per step: WR * XR accumulators + WR + 1 operands in registers
// Calls with fewer multiply-adds than this run on the calling thread (a parallel region costs more).
constexpr int64_t SERIAL_MACS = int64_t(1) << 16;
constexpr int64_t PREFETCH_ROW_BYTES = 4096;  // software prefetch for weight rows up to this size (see above)

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));       // unaligned fp32 load
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vhu __attribute__((vector_size(VL * 2), aligned(2)));    // VL bf16, unaligned
typedef int32_t viu __attribute__((vector_size(VL * 4), aligned(2)));     // 2 * VL bf16 as words, unaligned

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
// VL bf16 values widened to fp32 (exact: a bf16 is the high half of an fp32).
inline vf load(const uint16_t* p) {
    const vu bits = __builtin_convertvector(*reinterpret_cast<const vhu*>(p), vu) << 16;
    vf out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

inline float scalar(float x) { return x; }
inline float scalar(uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

// fp32 to the nearest even bf16 (NaN stays NaN, made quiet), as torch rounds.
inline uint16_t to_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline void store(float* y, float v) { *y = v; }
inline void store(uint16_t* y, float v) { *y = to_bf16(v); }

inline float hsum(vf v) {
    float s = 0.f;
#pragma GCC unroll 16
    for (int i = 0; i < VL; ++i) s += v[i];
    return s;
}

// out[i][r] = dot(w[i][0:K], x[r][0:K]) for WR weight rows and XRows input rows; next: the rows of the
// block computed after this one, prefetched if Prefetch.
template <int XRows, bool Prefetch, class T>
inline void dot_block(const T* const (&w)[WR], const T* const (&next)[WR], const T* const (&x)[XRows], int64_t K,
                      float (&out)[WR][XRows]) {
    vf acc[WR][XRows] = {};
    int64_t k = 0;
#ifdef RETMASK_BF16_DOT
    if constexpr (std::is_same_v<T, uint16_t>) {
        static_assert(VL == 16, "the avx512bf16 build has 16 lanes");
        for (; k + 2 * VL <= K; k += 2 * VL) {
            __m512bh wv[WR];
#pragma GCC unroll 4
            for (int i = 0; i < WR; ++i) {
                wv[i] = reinterpret_cast<__m512bh>(*reinterpret_cast<const viu*>(w[i] + k));
                if constexpr (Prefetch) __builtin_prefetch(next[i] + k);
            }
#pragma GCC unroll 4
            for (int r = 0; r < XRows; ++r) {
                const __m512bh xv = reinterpret_cast<__m512bh>(*reinterpret_cast<const viu*>(x[r] + k));
#pragma GCC unroll 4
                for (int i = 0; i < WR; ++i)
                    acc[i][r] = reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[i][r]), wv[i], xv));
            }
        }
    }
#endif
    for (; k + VL <= K; k += VL) {
        vf wv[WR];
#pragma GCC unroll 4
        for (int i = 0; i < WR; ++i) {
            wv[i] = load(w[i] + k);
            if constexpr (Prefetch) __builtin_prefetch(next[i] + k);
        }
#pragma GCC unroll 4
        for (int r = 0; r < XRows; ++r) {
            const vf xv = load(x[r] + k);
#pragma GCC unroll 4
            for (int i = 0; i < WR; ++i) acc[i][r] += wv[i] * xv;
        }
    }
    for (int i = 0; i < WR; ++i)
        for (int r = 0; r < XRows; ++r) {
            float s = hsum(acc[i][r]);
            for (int64_t t = k; t < K; ++t) s += scalar(w[i][t]) * scalar(x[r][t]);
            out[i][r] = s;
        }
}

// y[r0 + r][n0 + i] for the valid rows r < nr and weight rows i < nw of one step.
template <int XRows, class T>
inline void store_block(const float (&out)[WR][XRows], const T* bias, T* y, int64_t N, int64_t r0, int nr,
                        int64_t n0, int nw) {
    for (int r = 0; r < nr; ++r)
        for (int i = 0; i < nw; ++i)
            store(y + (r0 + r) * N + n0 + i, out[i][r] + (bias ? scalar(bias[n0 + i]) : 0.f));
}

template <bool Prefetch, class T>
void run_blocks(const LinearKernelArgs& a, int threads) {
    const T* W = static_cast<const T*>(a.weight);
    const T* X = static_cast<const T*>(a.x);
    const T* bias = static_cast<const T*>(a.bias);
    T* Y = static_cast<T*>(a.y);
    const int64_t blocks = (a.N + WR - 1) / WR;
    if (a.rows * a.N * a.K < SERIAL_MACS) threads = 1;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n0 = b * WR;
        const int nw = static_cast<int>(std::min<int64_t>(WR, a.N - n0));
        const T *w[WR], *next[WR];
        for (int i = 0; i < WR; ++i) {
            w[i] = W + std::min<int64_t>(n0 + i, a.N - 1) * a.w_stride;
            next[i] = W + std::min<int64_t>(n0 + WR + i, a.N - 1) * a.w_stride;
        }
        if (a.rows == 1) {  // a decode step: one accumulator per weight row
            const T* x[1] = {X};
            float out[WR][1];
            dot_block<1, Prefetch>(w, next, x, a.K, out);
            store_block<1>(out, bias, Y, a.N, 0, 1, n0, nw);
            continue;
        }
        for (int64_t r0 = 0; r0 < a.rows; r0 += XR) {
            const int nr = static_cast<int>(std::min<int64_t>(XR, a.rows - r0));
            const T* x[XR];
            for (int r = 0; r < XR; ++r) x[r] = X + std::min<int64_t>(r0 + r, a.rows - 1) * a.x_stride;
            float out[WR][XR];
            dot_block<XR, Prefetch>(w, next, x, a.K, out);
            store_block<XR>(out, bias, Y, a.N, r0, nr, n0, nw);
        }
    }
}

template <class T>
void run_typed(const LinearKernelArgs& a, int threads) {
    if (a.K * static_cast<int64_t>(sizeof(T)) <= PREFETCH_ROW_BYTES)
        run_blocks<true, T>(a, threads);
    else
        run_blocks<false, T>(a, threads);
}

}  // namespace
}  // namespace linear_kernel

void linear_rows(const LinearKernelArgs& a, DType dtype, int threads) {
    if (dtype == DType::BFloat16)
        linear_kernel::run_typed<uint16_t>(a, threads);
    else
        linear_kernel::run_typed<float>(a, threads);
}

}  // namespace retmask::detail::RETMASK_ISA
