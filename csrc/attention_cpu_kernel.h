// The ISA-generic body of the fused CPU attention kernel, compiled once per instruction set.
//
// Fused flash-style CPU attention with per-row argmax of the logits and head skipping.
//
// One pass over the keys per tile of query rows: S = (scale*Q) K^T on a key block, online softmax
// carrying the running max logit *and its key index* per row (strictly greater replaces, so ties keep
// the smallest key index), O += P V. Memory is linear in N: a thread holds one Q tile, one logit block,
// one O accumulator (and, for fp16/bf16 or strided K/V, one fp32 copy of the K/V block).
//
// Work items: (batch, kv head, block of query rows) with all *active* query heads of that kv group
// stacked as tile rows (GQA/MQA share one K/V block; no repeat). Skipped heads create no rows, so they
// cost nothing beyond writing their zeros / -1. Items are sorted by causal cost (largest first) and
// handed out dynamically by OpenMP, which balances the causal triangle.
//
// Two tile layouts: "lanes" (query rows in vector lanes; prefill, >= 16 rows per tile) and "rowmajor"
// (dot products along D, rows in registers; decode-sized tiles). fp16/bf16 are converted to fp32 on
// load; all accumulation is fp32. bf16 calls may run the lanes layout's products as bf16 dot products
// (bf16_dot: pairs of bf16 per 32-bit lane, vdpbf16ps where the build has AVX512-BF16).
//
// Features (the contract of retmask/kernels/reference.py): a sliding window visits only the key blocks
// meeting the window of some tile row (O(M * window) work, not O(M * N)) and masks per row in the blocks
// on its lower edge; sink tokens (keys < sink, seen besides the window) add the blocks holding them, cut at
// the last sink token, and are exempt from the window mask (O(M * (window + sink))); soft-capping maps each logit block through c * tanh(s / c) (vtanh) right after
// QK^T, before masking, max, argmax and exp; sinks join the denominator when a row is normalised
// (store_row). Masking is always a select to -inf, never an add, so a NaN / inf logit of a key a row
// may not see cannot reach that row.
//
// Builds: attention_cpu_{avx512,avx2,generic}.cpp include this file after their standard headers, with
// RETMASK_VL (vector lanes) and RETMASK_ISA (namespace) defined and, on x86, a `#pragma GCC target` for
// their instruction set; attention_cpu.cpp checks the arguments and calls the widest build this CPU runs
// (detail::<isa>::run). Everything here has internal linkage, so the builds never share a function.
// Failed allocations throw std::bad_alloc outside any OpenMP region; nothing inside one allocates or throws.
#include "attention_cpu_internal.h"

#ifndef RETMASK_VL
#error "define RETMASK_VL (8 or 16) and RETMASK_ISA before including attention_cpu_kernel.h"
#endif

namespace retmask::detail::RETMASK_ISA {
namespace {

using Args = KernelArgs;


// VL fp32 lanes: 16 (one zmm register) in the AVX-512 build, 8 (one ymm) in the AVX2 and generic builds.
// A vector type wider than the target's registers is lowered piecewise through the stack by GCC (the
// 16-lane type on an AVX2-only CPU is several times slower), so each build uses its native width.
constexpr int VL = RETMASK_VL;
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));  // unaligned access
typedef int32_t vi __attribute__((vector_size(VL * 4)));
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline vf vload(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void vstore(float* p, vf x) { *reinterpret_cast<vf*>(p) = x; }
inline vf vloadu(const float* p) { return *reinterpret_cast<const vfu*>(p); }
// All lanes in one initializer, so that GCC emits a single `vbroadcastss` (from memory when x was just
// loaded). `vf{} + x` adds +0 first (not a no-op for x = -0): an extra scalar add on the way to the FMAs,
// and a zero register that pushed the AVX2 micro-kernels to 17 live ymm values (one accumulator spilled).
template <std::size_t... I>
inline vf broadcast_lanes(float x, std::index_sequence<I...>) {
    return vf{(static_cast<void>(I), x)...};
}
inline vf vbroadcast(float x) { return broadcast_lanes(x, std::make_index_sequence<VL>{}); }

// exp(x) for x <= 0 (softmax arguments): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, and p the
// degree-5 polynomial closest to e^r in relative error (Lawson fit, 9e-8); |rel err| <= 1.7e-7 over
// [-87, 0] in fp32. Arguments are clamped at -88, where n = -127 makes the scale 2^n exactly +0, so
// -inf (masked keys) and everything below about -87.7 give exactly 0 without a final select; NaN stays
// NaN (the clamp keeps NaN lanes).
inline vf vexp(vf x) {
    const vf lo = vbroadcast(-88.0f);
    const vf xc = x < lo ? lo : x;
    const vf t = xc * 1.44269504088896341f;
    const vf magic = vbroadcast(12582912.0f);  // 1.5 * 2^23: round to nearest integer
    const vf n = (t + magic) - magic;
    vf r = xc - n * 0.693359375f;  // ln2 in two parts, so r keeps its low bits
    r = r - n * -2.12194440e-4f;
    vf p = vbroadcast(8.29031505e-3f);
    p = p * r + 4.18979302e-2f;
    p = p * r + 1.66676357e-1f;
    p = p * r + 4.99991506e-1f;
    p = p * r + 9.99999702e-1f;
    p = p * r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    std::memcpy(&scale, &e, sizeof(scale));
    return p * scale;
}

// tanh(x) (Cephes tanhf): x + x^3 P(x^2) for |x| < 0.625, else (1 - e) / (1 + e) with e = exp(-2|x|)
// from vexp (0 below about -87.7, so large |x| give exactly 1), sign restored. |rel err| ~ 2e-7 over
// the whole range; +-inf -> +-1, NaN -> NaN, -0 -> -0.
inline vf vtanh(vf x) {
    vi bits;
    std::memcpy(&bits, &x, sizeof(bits));
    const vi sign = bits & static_cast<int32_t>(0x80000000u);
    const vi abits = bits & 0x7fffffff;
    vf ax;
    std::memcpy(&ax, &abits, sizeof(ax));
    const vf e = vexp(ax * -2.0f);
    const vf big = (1.0f - e) / (1.0f + e);
    const vf z = ax * ax;
    vf p = vbroadcast(-5.70498872745e-3f);
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const vf small = p * z * ax + ax;
    const vf t = ax < vbroadcast(0.625f) ? small : big;
    vi tbits;
    std::memcpy(&tbits, &t, sizeof(tbits));
    tbits |= sign;
    vf res;
    std::memcpy(&res, &tbits, sizeof(res));
    return res;
}

inline float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < VL; ++i) m = std::max(m, x[i]);
    return m;
}
inline float hsum(vf x) {  // fixed pairwise order: VL -> ... -> 4 -> 2 -> 1
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
#if RETMASK_VL == 16
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    static_assert(VL == 8, "vector builds have 8 or 16 lanes");
    v8 a = x;
#endif
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

// ---- element types -------------------------------------------------------------------------------
struct F32 {
    using T = float;
    static float load(const T* p) { return *p; }
    static void store(T* p, float x) { *p = x; }
};
struct F16 {
    using T = _Float16;
    static float load(const T* p) { return static_cast<float>(*p); }
    static void store(T* p, float x) { *p = static_cast<_Float16>(x); }
};
struct BF16 {
    using T = uint16_t;
    static float load(const T* p) {
        uint32_t u = static_cast<uint32_t>(*p) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    static void store(T* p, float x) {  // round to nearest even, like torch's .to(bfloat16)
        uint32_t u;
        std::memcpy(&u, &x, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            *p = 0x7fc0;
            return;
        }
        u += 0x7fffu + ((u >> 16) & 1u);
        *p = static_cast<uint16_t>(u >> 16);
    }
};

// f(E{}) for the element type E of a call's dtype (checked to be one of the three before).
template <class F>
void by_dtype(DType dtype, F&& f) {
    switch (dtype) {
        case DType::Float32: f(F32{}); break;
        case DType::Float16: f(F16{}); break;
        default: f(BF16{}); break;
    }
}

// Forced inlining keeps the dispatch helpers and their lambdas out of the generated code: the loops
// below compile to what hand-written switch statements give (checked with bench/bench_kernel_ab.py).
#define RETMASK_INLINE inline __attribute__((always_inline))
#define RETMASK_LAMBDA_INLINE __attribute__((always_inline))

// ---- micro-kernels ---------------------------------------------------------------------------------
// The tile is kept transposed so that query rows live in vector lanes: Qt [D][RP], St [BN][RP],
// Ot [D][RP] (RP = rows rounded up to VL). K and V are read row-major straight from the input (or a
// converted fp32 copy) and broadcast one scalar at a time, so nothing is transposed and the softmax
// (max, exp, sum, argmax, rescale) is element-wise over rows with no horizontal reductions.

// The one FMA micro-kernel every block product runs on (the forward's layouts below, and the five
// products of the backward, attention_bwd_cpu_kernel.h):
// C[r][c] = (ACC ? C[r][c] : 0) + sum_{k0 <= k < k1} A[r * ars + k * aks] * B[k * ldb + c] for NR rows and
// CV * VL columns (B and C rows aligned at every vector). A is read one broadcast scalar at a time through
// its two strides, so a transposed A costs nothing; each C element is one FMA chain over k in order.
// Forced inline, so that constant strides (1) fold into the addressing.
template <int NR, int CV, bool ACC>
RETMASK_INLINE void fma_tile(const float* __restrict A, int64_t ars, int64_t aks, const float* __restrict B,
                             int64_t ldb, float* __restrict C, int64_t ldc, int64_t k0, int64_t k1) {
    vf acc[NR][CV];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < CV; ++c) acc[r][c] = ACC ? vload(C + r * ldc + c * VL) : vf{};
    for (int64_t k = k0; k < k1; ++k) {
        vf b[CV];
#pragma GCC unroll 4
        for (int c = 0; c < CV; ++c) b[c] = vload(B + k * ldb + c * VL);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
            const vf x = vbroadcast(A[r * ars + k * aks]);
#pragma GCC unroll 4
            for (int c = 0; c < CV; ++c) acc[r][c] += x * b[c];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < CV; ++c) vstore(C + r * ldc + c * VL, acc[r][c]);
}

// St[j][r] = sum_d K[j][d] * Qt[d][r] for NJ keys x RV*VL rows. Every logit is the same FMA chain
// over d = 0..D-1 whatever its position in a tile, so duplicate keys give bit-identical logits and
// ties resolve to the smallest index, as in torch.
template <int NJ, int RV>
inline void qk_tile(const float* __restrict K, int64_t ldk, const float* __restrict Qt, int RP,
                    float* __restrict St, int D) {
    fma_tile<NJ, RV, false>(K, ldk, 1, Qt, RP, St, RP, 0, D);
}

// Ot[d][r] += sum_j V[j][d] * P[j][r] for ND head dims x RV*VL rows, keys j < nj.
template <int ND, int RV>
inline void pv_tile(const float* __restrict V, int64_t ldv, const float* __restrict P, int RP,
                    float* __restrict Ot, int nj) {
    fma_tile<ND, RV, true>(V, 1, ldv, P, RP, Ot, RP, 0, nj);
}

// Register blocking of the micro-kernels: accumulators + one row of operands + one broadcast must fit the
// vector registers (32 zmm with AVX-512, 16 ymm with AVX2), or the tile spills to the stack.
#if RETMASK_VL == 16
constexpr int NJ_QK = 6;  // 6 keys x 4 row vectors = 24 accumulators (of 32 zmm registers)
constexpr int ND_PV = 6;  // 6 head dims x 4 row vectors = 24 accumulators
constexpr int RV_MAX = 4;
constexpr int MR_PV = 8;  // row-major PV: 8 rows x 2 vectors = 16 accumulators
#else
constexpr int NJ_QK = 4;  // 4 keys x 3 row vectors = 12 accumulators + 3 Q vectors + 1 broadcast (16 ymm)
constexpr int ND_PV = 4;  // 4 head dims x 3 row vectors = 12 accumulators + 3 P vectors + 1 broadcast
constexpr int RV_MAX = 3;
constexpr int MR_PV = 6;  // row-major PV: 6 rows x 2 vectors = 12 accumulators + 2 V vectors + 1 broadcast
#endif


// f(std::integral_constant<int, n>{}) for a runtime n in [1, N] (nothing for n outside): turns the
// remainder of a tile loop into a template argument, so tails get their own unrolled micro-kernel.
template <int N, class F>
RETMASK_INLINE void with_width(int n, F&& f) {
    if constexpr (N >= 1) {
        if (n == N) {
            f(std::integral_constant<int, N>{});
            return;
        }
        with_width<N - 1>(n, f);
    }
}

// f(width, start) over [0, n): full tiles of T, then one narrower tile for the remainder.
template <int T, class F>
RETMASK_INLINE void tiles(int n, F&& f) {
    int i = 0;
    for (; i + T <= n; i += T) f(std::integral_constant<int, T>{}, i);
    with_width<T - 1>(n - i, [&](auto w) RETMASK_LAMBDA_INLINE { f(w, i); });
}

// Logits of keys [0, nj) for all RP rows: tiles of NJ_QK keys x RV_MAX row vectors.
void qk_block(const float* K, int64_t ldk, const float* Qt, int RP, float* St, int D, int nj) {
    tiles<RV_MAX>(RP / VL, [&](auto rv, int c) RETMASK_LAMBDA_INLINE {
        tiles<NJ_QK>(nj, [&](auto w, int j) RETMASK_LAMBDA_INLINE {
            qk_tile<decltype(w)::value, decltype(rv)::value>(K + j * ldk, ldk, Qt + c * VL, RP,
                                                             St + j * RP + c * VL, D);
        });
    });
}

// O += P V for all RP rows: tiles of ND_PV head dims x RV_MAX row vectors.
void pv_block(const float* V, int64_t ldv, const float* P, int RP, float* Ot, int D, int nj) {
    tiles<RV_MAX>(RP / VL, [&](auto rv, int c) RETMASK_LAMBDA_INLINE {
        tiles<ND_PV>(D, [&](auto w, int d) RETMASK_LAMBDA_INLINE {
            pv_tile<decltype(w)::value, decltype(rv)::value>(V + d, ldv, P + c * VL, RP,
                                                             Ot + d * RP + c * VL, nj);
        });
    });
}

// ---- bf16 dot-product micro-kernels (the "bf16dot" lanes layout: bfloat16 calls, even head dim) -------
// vdpbf16ps (AVX512-BF16) multiplies pairs of bf16 values held in one 32-bit lane and adds both products
// to an fp32 accumulator: twice the multiply-adds of an fp32 FMA per instruction. The lanes layout keeps
// its shape, with pairs along the reduced dimension: Qp [D/2][RP] holds (q[r][2p], q[r][2p+1]) per lane
// and each key contributes one broadcast word (k[j][2p], k[j][2p+1]), which in a bf16 row already sits as
// one 32-bit word; for O += P V the pairs run along keys: Pp [BN/2][RP] holds (P[2i][r], P[2i+1][r]) (P
// rounded to bf16, as torch's SDPA rounds it before its second product) and Vp [BN/2][D] the words
// (v[2i][d], v[2i+1][d]). A pair's low half is its first element (little-endian bf16 rows).
// The avx512bf16 build runs the instruction; the other builds emulate it bit for bit (the high products
// first, then the low ones, each product exact in fp32, as Intel's pseudo-code has it and as measured on
// hardware), so the layout is tested on every CPU. The instruction treats denormal bf16 inputs as zero
// and flushes denormal results; the emulation does not, so the two differ only where |x| < 2^-126 (P is
// flushed below that before rounding, which keeps it exact for P).
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

template <std::size_t... I>
inline vi broadcast_int_lanes(int32_t x, std::index_sequence<I...>) {
    return vi{(static_cast<void>(I), x)...};
}
// The 32-bit word at p (two bf16 values, any 2-byte alignment) in every lane.
inline vi broadcast_word(const uint16_t* p) {
    int32_t w;
    std::memcpy(&w, p, sizeof(w));
    return broadcast_int_lanes(w, std::make_index_sequence<VL>{});
}
inline vi viload(const int32_t* p) { return *reinterpret_cast<const vi*>(p); }
inline void vistore(int32_t* p, vi x) { *reinterpret_cast<vi*>(p) = x; }

// acc + a.hi * b.hi + a.lo * b.lo per lane (a, b: pairs of bf16).
inline vf dot2(vf acc, vi a, vi b) {
#ifdef RETMASK_BF16_DOT
    static_assert(VL == 16, "the avx512bf16 build has 16 lanes");
    return reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), reinterpret_cast<__m512bh>(a),
                                                 reinterpret_cast<__m512bh>(b)));
#else
    const vi hi_mask = vi{} + static_cast<int32_t>(0xffff0000u);
    const vi ahi = a & hi_mask, bhi = b & hi_mask, alo = a << 16, blo = b << 16;
    vf x, y, u, w;
    std::memcpy(&x, &ahi, sizeof(x));
    std::memcpy(&y, &bhi, sizeof(y));
    std::memcpy(&u, &alo, sizeof(u));
    std::memcpy(&w, &blo, sizeof(w));
    acc += x * y;  // exact product: fused or not, one rounding, as the instruction's first addition
    return acc + u * w;
#endif
}

// fp32 lanes rounded to the nearest even bf16 (NaN stays NaN, made quiet; |x| < 2^-126 becomes a signed
// zero: no denormal operands), as the bits of a float whose low 16 bits are zero.
inline vu bf16_rounded_bits(vf x) {
    vu u;
    std::memcpy(&u, &x, sizeof(u));
    const vu mag = u & 0x7fffffffu;
    vu r = u + (0x7fffu + ((u >> 16) & 1u));
    r = mag > 0x7f800000u ? (u | 0x00400000u) : r;
    r = mag < 0x00800000u ? (u & 0x80000000u) : r;
    return r & 0xffff0000u;
}
// Per lane (bf16(lo) | bf16(hi) << 16): two fp32 vectors as one vector of bf16 pairs.
inline vi pack_pairs(vf lo, vf hi) {
    const vu w = bf16_rounded_bits(hi) | (bf16_rounded_bits(lo) >> 16);
    vi out;
    std::memcpy(&out, &w, sizeof(out));
    return out;
}

// St[j][r] = scale * sum_p dot2(Qp[p][r], (k[j][2p], k[j][2p+1])) for NJ keys x RV*VL rows; key j's bf16
// row at K + j * ldk, Dh = D / 2 pairs. Same chain for every logit, so duplicate keys tie exactly.
template <int NJ, int RV>
inline void qk_tile_dot(const uint16_t* __restrict K, int64_t ldk, const int32_t* __restrict Qp, int RP,
                        float* __restrict St, int Dh, float scale) {
    vf acc[NJ][RV];
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) acc[j][c] = vf{};
    for (int p = 0; p < Dh; ++p) {
        vi qv[RV];
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) qv[c] = viload(Qp + p * RP + c * VL);
#pragma GCC unroll 8
        for (int j = 0; j < NJ; ++j) {
            const vi kw = broadcast_word(K + j * ldk + 2 * p);
#pragma GCC unroll 4
            for (int c = 0; c < RV; ++c) acc[j][c] = dot2(acc[j][c], qv[c], kw);
        }
    }
    const vf sv = vbroadcast(scale);
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) vstore(St + j * RP + c * VL, acc[j][c] * sv);
}

// Ot[d][r] += sum_i dot2(Pp[i][r], Vp[i][d]) for ND head dims x RV*VL rows, key pairs i < npairs; Vp
// rows of ldv words.
template <int ND, int RV>
inline void pv_tile_dot(const uint32_t* __restrict Vp, int64_t ldv, const int32_t* __restrict Pp, int RP,
                        float* __restrict Ot, int npairs) {
    vf acc[ND][RV];
#pragma GCC unroll 8
    for (int d = 0; d < ND; ++d)
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) acc[d][c] = vload(Ot + d * RP + c * VL);
    for (int i = 0; i < npairs; ++i) {
        vi pv[RV];
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) pv[c] = viload(Pp + i * RP + c * VL);
#pragma GCC unroll 8
        for (int d = 0; d < ND; ++d) {
            const vi vw = broadcast_int_lanes(static_cast<int32_t>(Vp[i * ldv + d]), std::make_index_sequence<VL>{});
#pragma GCC unroll 4
            for (int c = 0; c < RV; ++c) acc[d][c] = dot2(acc[d][c], pv[c], vw);
        }
    }
#pragma GCC unroll 8
    for (int d = 0; d < ND; ++d)
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) vstore(Ot + d * RP + c * VL, acc[d][c]);
}

void qk_block_dot(const uint16_t* K, int64_t ldk, const int32_t* Qp, int RP, float* St, int Dh, int nj, float scale) {
    tiles<RV_MAX>(RP / VL, [&](auto rv, int c) RETMASK_LAMBDA_INLINE {
        tiles<NJ_QK>(nj, [&](auto w, int j) RETMASK_LAMBDA_INLINE {
            qk_tile_dot<decltype(w)::value, decltype(rv)::value>(K + j * ldk, ldk, Qp + c * VL, RP,
                                                                 St + j * RP + c * VL, Dh, scale);
        });
    });
}

void pv_block_dot(const uint32_t* Vp, int64_t ldv, const int32_t* Pp, int RP, float* Ot, int D, int npairs) {
    tiles<RV_MAX>(RP / VL, [&](auto rv, int c) RETMASK_LAMBDA_INLINE {
        tiles<ND_PV>(D, [&](auto w, int d) RETMASK_LAMBDA_INLINE {
            pv_tile_dot<decltype(w)::value, decltype(rv)::value>(Vp + d, ldv, Pp + c * VL, RP,
                                                                 Ot + d * RP + c * VL, npairs);
        });
    });
}

// Key rows [j0, j0 + nj) of one (batch, kv head) as pairs of consecutive keys: dst[i * D + d] =
// (v[j0 + 2i][d], v[j0 + 2i + 1][d]), the second half zero past the last key.
inline void key_pairs(const uint16_t* base, const int64_t* st, int64_t j0, int nj, int64_t D, uint32_t* dst) {
    for (int i = 0; 2 * i < nj; ++i) {
        const uint16_t* a = base + (j0 + 2 * i) * st[2];
        const uint16_t* b = 2 * i + 1 < nj ? a + st[2] : nullptr;
        uint32_t* out = dst + i * D;
        if (b && st[3] == 1) {
            for (int64_t d = 0; d < D; ++d) out[d] = static_cast<uint32_t>(a[d]) | static_cast<uint32_t>(b[d]) << 16;
        } else {
            for (int64_t d = 0; d < D; ++d)
                out[d] = static_cast<uint32_t>(a[d * st[3]]) | (b ? static_cast<uint32_t>(b[d * st[3]]) << 16 : 0u);
        }
    }
}

// ---- row-major path (few rows per tile: decode) --------------------------------------------------
// For tiles with fewer than VL rows (decode, M = 1), where the lanes path would leave lanes idle:
// logits as dot products along D (K read in place), then O += P V with rows in registers and head
// dims in vector lanes (V packed [BN][Dp] per block).
namespace rowmajor {
// O[r][d] += sum_j P[r][j] * V[j][d] for MR rows, NV*VL output columns starting at column d0.
// P: [MR][BN], V: [BN][ldv], O: [MR][ldo]; only the first nj keys are read.
template <int MR, int NV>
inline void pv_tile(const float* __restrict P, int BN, const float* __restrict V, int ldv, float* __restrict O,
                    int ldo, int nj) {
    fma_tile<MR, NV, true>(P, BN, 1, V, ldv, O, ldo, 0, nj);
}

template <int MR>
void pv_rows(const float* P, int BN, const float* V, int ldv, float* O, int ldo, int Dp, int nj, int rows) {
    if constexpr (MR > 0) {
        if (rows >= MR) {
            int r = 0;
            for (; r + MR <= rows; r += MR) {
                int d = 0;
                for (; d + 2 * VL <= Dp; d += 2 * VL)
                    pv_tile<MR, 2>(P + r * BN, BN, V + d, ldv, O + r * ldo + d, ldo, nj);
                if (d < Dp) pv_tile<MR, 1>(P + r * BN, BN, V + d, ldv, O + r * ldo + d, ldo, nj);
            }
            if (r < rows) pv_rows<MR - 1>(P + r * BN, BN, V, ldv, O + r * ldo, ldo, Dp, nj, rows - r);
        } else {
            pv_rows<MR - 1>(P, BN, V, ldv, O, ldo, Dp, nj, rows);
        }
    }
}

// S[r][j] = dot(Q[r], K[j]) for rows r < R and keys j < nj, vectorised along D (K rows read in place,
// no transpose); S[r][nj..BN) = 0. Decode tiles have fewer than VL rows, too few to amortise packing K^T.
// Every logit is the same chain (VL-lane FMAs, fixed-order lane sum, scalar tail), so duplicate keys
// give bit-identical logits.
inline void qk_dot(const float* __restrict Q, int ldq, int R, const float* __restrict K, int64_t ldk, int D,
                   float* __restrict S, int BN, int nj) {
    const int D16 = D / VL * VL;
    for (int j = 0; j < nj; ++j) {
        const float* kr = K + j * ldk;
        for (int r = 0; r < R; ++r) {
            const float* qr = Q + r * ldq;
            vf acc = vf{};
            for (int d = 0; d < D16; d += VL) acc += vload(qr + d) * vloadu(kr + d);
            float s = hsum(acc);
            for (int d = D16; d < D; ++d) s += qr[d] * kr[d];
            S[r * BN + j] = s;
        }
    }
    if (nj < BN)
        for (int r = 0; r < R; ++r) std::memset(S + r * BN + nj, 0, sizeof(float) * (BN - nj));
}

}  // namespace rowmajor

// s[0..n) <- c * tanh(s / c) with s / c = (s * inv) * post (n a multiple of VL, s 64-byte aligned).
inline void softcap_block(float* __restrict s, int64_t n, float c, float inv, float post) {
    const vf cv = vbroadcast(c), iv = vbroadcast(inv), pv = vbroadcast(post);
    for (int64_t i = 0; i < n; i += VL) vstore(s + i, cv * vtanh(vload(s + i) * iv * pv));
}
struct Item {
    int64_t b, hkv, i0, i1;  // query rows [i0, i1)
    int64_t cost;
    // A piece of a split decode item (split_keys): keys [k0, k1) only, its rows' partial state left in
    // slot `part` of the call's partials instead of the output; part < 0: a whole item.
    int64_t k0 = 0, k1 = 0, part = -1;
};

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// ---- scratch memory ------------------------------------------------------------------------------
// All scratch of a call is one 64-byte aligned block allocated *before* the parallel region, so that a
// failed allocation throws std::bad_alloc to the caller (an exception inside an OpenMP region ends the
// process). The block holds one equal slice per thread; each thread zero-fills its own slice (first
// touch, as when every thread allocated its own buffers) and carves its arrays out of it.
class Scratch {
  public:
    Scratch(size_t slice_bytes, int slices)
        : slice_(static_cast<size_t>(round_up(std::max<int64_t>(static_cast<int64_t>(slice_bytes), 64), 64))) {
        p_ = static_cast<char*>(std::aligned_alloc(64, slice_ * static_cast<size_t>(slices)));
        if (!p_) throw std::bad_alloc();
    }
    ~Scratch() { std::free(p_); }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    // Slice t (t < slices), as it is.
    char* slice(int t) const { return p_ + slice_ * static_cast<size_t>(t); }
    // Slice t, zero-filled first.
    char* zeroed_slice(int t) const {
        char* s = slice(t);
        std::memset(s, 0, slice_);
        return s;
    }

  private:
    size_t slice_;
    char* p_;
};

// Consecutive 64-byte aligned arrays in one slice. Constructed without a base it only adds up their
// sizes (null pointers), which sizes the slice for the real carving.
class Carve {
  public:
    explicit Carve(char* base = nullptr) : base_(base) {}
    template <class T>
    T* take(int64_t n) {
        T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
        used_ += round_up(n * static_cast<int64_t>(sizeof(T)), 64);
        return p;
    }
    size_t bytes() const { return used_; }

  private:
    char* base_;
    size_t used_ = 0;
};

inline int thread_num() {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

// K or V rows [j0, j0 + nj) of one (batch, kv head) as fp32 rows: the input itself when it already is
// contiguous fp32 along D (unless copy_fp32), else a converted copy in buf [nj][D].
template <class E>
const float* rows_fp32(const typename E::T* base, const int64_t* st, int64_t j0, int nj, int64_t D,
                       float* buf, int64_t* ld, bool copy_fp32 = false) {
    if constexpr (std::is_same_v<E, F32>) {
        if (st[3] == 1 && !copy_fp32) {
            *ld = st[2];
            return base + j0 * st[2];
        }
    }
    for (int j = 0; j < nj; ++j) {
        const typename E::T* src = base + (j0 + j) * st[2];
        float* dst = buf + j * D;
        if (st[3] == 1) {
            for (int64_t d = 0; d < D; ++d) dst[d] = E::load(src + d);
        } else {
            for (int64_t d = 0; d < D; ++d) dst[d] = E::load(src + d * st[3]);
        }
    }
    *ld = D;
    return buf;
}

// First key of the first block a tile whose first row sits at min_pos visits: the block holding the start
// of that row's window (rows further down see later keys only), 0 without a window.
inline int64_t first_block_key(const Args& a, int64_t min_pos) {
    if (!a.window) return 0;
    return std::max<int64_t>(0, min_pos - a.window + 1) / a.block_n * a.block_n;
}

// Sink tokens: the keys [0, sink_end) a tile whose first row sits at min_pos visits in blocks of their own,
// before the window's blocks (which start at first_block_key and include any sink token from there on):
// the sink tokens below that block, 0 without sink tokens. So a tile visits O(window + rows + sink) keys.
inline int64_t sink_end(const Args& a, int64_t min_pos) {
    return a.sink ? std::min<int64_t>(a.sink, first_block_key(a, min_pos)) : 0;
}

struct Plan {
    int64_t g, nblk;
    int64_t max_rows = 0;  // most tile rows of any item (scratch size)
    int64_t work = 0;      // sum over items of visited keys x rows x D (~ multiply-adds of QK^T; split_keys)
    // Below this the call runs on one thread: waking a second one costs more than it saves (and on a
    // busy machine it can cost milliseconds: the scheduler must find it a core). ~0.1-0.2 ms of work.
    static constexpr int64_t kParallelWork = int64_t(1) << 21;
    // A split decode call streams its keys from memory (one row per head: few flops per byte), so the same
    // time is spent at a quarter of the multiply-adds (counted over every head of its active KV groups).
    static constexpr int64_t kParallelDecodeWork = kParallelWork / 4;
    bool parallel() const { return work >= (whole.empty() ? kParallelWork : kParallelDecodeWork) && items.size() > 1; }
    std::vector<uint8_t> blk_state;  // per batch, per key block: 0 none valid, 1 some, 2 all
    std::vector<Item> items;         // sorted by cost (visited keys x rows), largest first
    // Split decode (split_keys): the whole items, each cut into `pieces` items at fixed key positions.
    std::vector<Item> whole;
    int64_t pieces = 1;
};

// Work items, key-block validity, and the zeros / -1 of skipped heads (their only "work").
template <class E>
Plan make_plan(const Args& a) {
    using T = typename E::T;
    T* out = static_cast<T*>(a.out);
    const int64_t B = a.B, Hq = a.Hq, Hkv = a.Hkv, M = a.M, N = a.N, D = a.D, T_ = a.T;
    const int BN = a.block_n;
    Plan plan;
    const int64_t g = plan.g = Hq / Hkv;
    // Skipped heads: zeros and -1, nothing else.
    if (a.skip) {
        for (int64_t b = 0; b < B; ++b)
            for (int64_t h = 0; h < Hq; ++h) {
                if (!a.skip[b * Hq + h]) continue;
                for (int64_t i = 0; i < M; ++i) {
                    T* o = out + b * a.os[0] + h * a.os[1] + i * a.os[2];
                    for (int64_t d = 0; d < D; ++d) E::store(o + d * a.os[3], 0.f);
                }
                if (a.argmax && T_)
                    for (int64_t t = 0; t < T_; ++t) a.argmax[(b * Hq + h) * T_ + t] = -1;
            }
    }

    // Per batch, per key block: 0 = no valid key, 1 = some, 2 = all valid (skip / mask / no mask).
    const int64_t nblk = plan.nblk = (N + BN - 1) / BN;
    std::vector<uint8_t>& blk_state = plan.blk_state;
    if (a.kpm) {
        blk_state.resize(B * nblk);
        for (int64_t b = 0; b < B; ++b)
            for (int64_t jb = 0; jb < nblk; ++jb) {
                int64_t cnt = 0, j0 = jb * BN, j1 = std::min<int64_t>(N, j0 + BN);
                for (int64_t j = j0; j < j1; ++j) cnt += a.kpm[b * N + j] != 0;
                blk_state[b * nblk + jb] = cnt == 0 ? 0 : (cnt == j1 - j0 ? 2 : 1);
            }
    }

    std::vector<Item>& items = plan.items;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t hk = 0; hk < Hkv; ++hk) {
            int64_t active = 0;
            for (int64_t h = hk * g; h < (hk + 1) * g; ++h) active += !(a.skip && a.skip[b * Hq + h]);
            if (!active) continue;
            // About block_m tile rows per item over the group's *active* heads, so a partly skipped
            // group still fills the vector lanes (64 rows = 4 or 8 full vectors for 1, 2 or 4 heads).
            const int64_t bm = std::max<int64_t>(1, a.block_m / active);
            plan.max_rows = std::max(plan.max_rows, active * std::min(bm, M));
            for (int64_t i0 = 0; i0 < M; i0 += bm) {
                int64_t i1 = std::min(M, i0 + bm);
                // Keys of the visited blocks: from the block holding the first row's window start.
                int64_t keys = (a.causal ? N - M + i1 : N) - first_block_key(a, N - M + i0) + sink_end(a, N - M + i0);
                items.push_back({b, hk, i0, i1, keys * active * (i1 - i0)});
            }
        }
    std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
    for (const Item& it : items) plan.work += it.cost * D;
    return plan;
}

// ---- the part both tile layouts share -----------------------------------------------------------------

// One work item as its tile sees it: rows r < R are query row row_i[r] of head row_h[r] (the active heads
// of the kv group, each with the item's query rows) at positions min_pos..max_pos; keys [key_begin,
// key_end) can be valid for some row, keys up to min_pos are in the past of every row, and (window)
// keys from win_edge on are inside the window of every row. Sink tokens: keys [0, sink_end) are visited
// too, in blocks of their own before key_begin's (sink_end <= key_begin's block).
struct Tile {
    int64_t b, hk;
    int R;
    const int64_t *row_h, *row_i;
    int64_t min_pos, max_pos, key_begin, key_end, win_edge;
    int64_t part;  // >= 0: a piece of a split decode item, whose rows leave partial states in this slot
    int64_t sink_end;
    int64_t* visited;  // the thread's count of computed logits (key-block visits x R)
};

// Runs body(bufs, tile) over the work items on `threads` OpenMP threads (dynamic schedule, largest items
// first). carve(Carve&) lays out the per-thread arrays of a tile layout and returns them as `bufs`; the
// scratch for every thread is allocated here, before the region (std::bad_alloc to the caller).
template <class Carver, class Body>
RETMASK_INLINE void for_each_item(const Args& a, const Plan& plan, int threads, Carver&& carve, Body&& body) {
    const int64_t rows = round_up(plan.max_rows, VL);
    Carve sizing;
    carve(sizing);
    sizing.take<int64_t>(rows);
    sizing.take<int64_t>(rows);
    const Scratch scratch(sizing.bytes(), threads);
    const int64_t n_items = static_cast<int64_t>(plan.items.size());
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        Carve c(scratch.zeroed_slice(thread_num()));
        const auto bufs = carve(c);
        int64_t* row_h = c.take<int64_t>(rows);
        int64_t* row_i = c.take<int64_t>(rows);
        int64_t visited = 0;  // this thread's logits, added to a.visited once at the end
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; ++it) {
            const Item& w = plan.items[it];
            int R = 0;
            for (int64_t h = w.hkv * plan.g; h < (w.hkv + 1) * plan.g; ++h) {
                if (a.skip && a.skip[w.b * a.Hq + h]) continue;
                for (int64_t i = w.i0; i < w.i1; ++i, ++R) {
                    row_h[R] = h;
                    row_i[R] = i;
                }
            }
            const int64_t min_pos = a.N - a.M + w.i0, max_pos = a.N - a.M + w.i1 - 1;
            int64_t key_begin = a.window ? std::max<int64_t>(0, min_pos - a.window + 1) : 0;
            int64_t key_end = a.causal ? max_pos + 1 : a.N;
            int64_t sinks_end = sink_end(a, min_pos);
            if (w.part >= 0) {
                // Only a split row's first piece (which starts at the window) visits its sink tokens.
                if (w.k0 != key_begin) sinks_end = 0;
                key_begin = w.k0;
                key_end = w.k1;
            }
            const int64_t win_edge = a.window ? max_pos - a.window + 1 : 0;
            body(bufs, Tile{w.b, w.hkv, R, row_h, row_i, min_pos, max_pos, key_begin, key_end, win_edge, w.part,
                            sinks_end, &visited});
        }
        if (a.visited) {
#pragma omp atomic
            *a.visited += visited;
        }
    }
}

// f(j0, nj, state) for the key blocks [j0, j0 + nj) of tile t that hold a valid key of its batch row, in
// increasing key order (so ties keep the smallest key index): the sink tokens' blocks, cut at t.sink_end,
// then the blocks meeting [t.key_begin, t.key_end) (aligned to block_n). state: 1 = some keys valid,
// 2 = all (no key padding mask: 2). Adds the logits it hands out (nj x t.R) to *t.visited.
template <class F>
RETMASK_INLINE void for_each_key_block(const Args& a, const Plan& plan, const Tile& t, F&& f) {
    const int BN = a.block_n;
    const int64_t b = t.b;
    int64_t keys = 0;
    // Sink tokens below the window's first block: every key of these cut blocks is a sink token, which
    // every row of the tile sees (all lie below its first row's window, hence in its past).
    for (int64_t j0 = 0; j0 < t.sink_end; j0 += BN) {
        const uint8_t st = a.kpm ? plan.blk_state[b * plan.nblk + j0 / BN] : 2;
        if (st == 0) continue;
        const int nj = static_cast<int>(std::min<int64_t>(BN, t.sink_end - j0));
        keys += nj;
        f(j0, nj, st);
    }
    for (int64_t j0 = t.key_begin / BN * BN; j0 < t.key_end; j0 += BN) {
        const uint8_t st = a.kpm ? plan.blk_state[b * plan.nblk + j0 / BN] : 2;
        if (st == 0) continue;  // no valid key in this block (e.g. left padding)
        const int nj = static_cast<int>(std::min<int64_t>(BN, t.key_end - j0));
        keys += nj;
        f(j0, nj, st);
    }
    *t.visited += keys * t.R;
}

// dst[d * step] = scale * q[b, h, i, d] in fp32.
template <class E>
RETMASK_INLINE void load_q_row(const Args& a, int64_t b, int64_t h, int64_t i, float* dst, int64_t step) {
    const typename E::T* qp = static_cast<const typename E::T*>(a.q) + b * a.qs[0] + h * a.qs[1] + i * a.qs[2];
    for (int64_t d = 0; d < a.D; ++d) dst[d * step] = E::load(qp + d * a.qs[3]) * a.scale;
}

// Normalise and write out one tile row: out[b, h, i, d] = o[d * step] / l, and its argmax if wanted; o and
// l are relative to the running max m. Rows that never saw a valid key (l == 0) give 0 and -1; poisoned
// rows (l NaN: a NaN / +inf logit, which also made o NaN) give NaN and -1. A sink joins the denominator
// here, against the safe max m' = max(m, sink): out = o e^{m-m'} / (l e^{m-m'} + e^{sink-m'}).
template <class E>
RETMASK_INLINE void store_row(const Args& a, int64_t b, int64_t h, int64_t i, const float* o, int64_t step,
                              float m, float l, bool want, int64_t am) {
    typename E::T* op = static_cast<typename E::T*>(a.out) + b * a.os[0] + h * a.os[1] + i * a.os[2];
    float inv = l > 0.f ? 1.f / l : 0.f;
    if (a.sinks && l > 0.f) {
        const float sink = a.sinks[h];
        const float mx = sink > m ? sink : m;  // a NaN sink keeps m, then e^{NaN} makes the row NaN
        const float alpha = std::exp(m - mx);
        inv = alpha / (l * alpha + std::exp(sink - mx));
    }
    for (int64_t d = 0; d < a.D; ++d) E::store(op + d * a.os[3], o[d * step] * inv);
    if (want) a.argmax[(b * a.Hq + h) * a.T + (i - (a.M - a.T))] = l > 0.f ? am : -1;
}

// Row state of a row-major tile before its first key block: positions, which rows want an argmax, no
// max / sum / argmax yet, a zero accumulator Ot[r][0..Dp).
RETMASK_INLINE void start_rows(const Args& a, const Tile& t, float* Ot, int Dp, float* m, float* l, int64_t* am,
                               int64_t* pos, uint8_t* want) {
    for (int r = 0; r < t.R; ++r) {
        const int64_t i = t.row_i[r];
        pos[r] = a.N - a.M + i;
        want[r] = a.argmax && a.T && i >= a.M - a.T;
        m[r] = NEG_INF;
        l[r] = 0.f;
        am[r] = -1;
        std::memset(Ot + static_cast<int64_t>(r) * Dp, 0, sizeof(float) * Dp);
    }
}

// ---- row-major online softmax ----------------------
// One key block [j0, j0 + nj) of a tile whose logits S [R][BN] are row-major (columns from nj on hold
// finite filler): masks padding, the tail past nj, future keys (causal) and keys before a row's window to
// -inf (a select), folds the block into each row's running max m[r], argmax am[r] (rows with want[r]) and
// sum l[r], rescales the row's accumulator Ot[r][0..Dp) when its max grows, and leaves e^{s - m} in S
// (0 for masked keys and for rows with nothing valid in the block).
// Distinct arrays (restrict): stores to them cannot change a, t, or each other.
RETMASK_INLINE void softmax_rows(const Args& a, const Tile& t, int64_t j0, int nj, uint8_t st, float* __restrict S,
                                 int BN, float* __restrict Ot, int Dp, float* __restrict m, float* __restrict l,
                                 int64_t* __restrict am, const int64_t* __restrict pos,
                                 const uint8_t* __restrict want, float* __restrict kbias) {
    const int64_t b = t.b, N = a.N;
    const int R = t.R;
    // Key validity for this block: 0 = valid, -inf = padding or tail past key_end (a select mask).
    const bool need_bias = st == 1 || nj < BN;
    if (need_bias)
        for (int j = 0; j < BN; ++j)
            kbias[j] = (j < nj && (!a.kpm || a.kpm[b * N + j0 + j])) ? 0.f : NEG_INF;
    const bool diag = a.causal && j0 + BN - 1 > t.min_pos;
    const bool edge = a.window && j0 < t.win_edge;  // keys below some row's window

    for (int r = 0; r < R; ++r) {
        float* s = S + static_cast<int64_t>(r) * BN;
        if (need_bias)
            for (int j = 0; j < BN; j += VL)
                vstore(s + j, vload(kbias + j) == vf{} ? vload(s + j) : vbroadcast(NEG_INF));
        if (diag) {
            const int64_t lim = pos[r] - j0;  // keys j > lim are in the future
            for (int64_t j = std::max<int64_t>(0, lim + 1); j < BN; ++j) s[j] = NEG_INF;
        }
        if (edge) {  // keys j < lo are before this row's window; sink tokens (j0 + j < sink) stay
            const int64_t lo = std::min<int64_t>(BN, pos[r] - a.window + 1 - j0);
            for (int64_t j = std::max<int64_t>(0, a.sink - j0); j < lo; ++j) s[j] = NEG_INF;
        }
        vf mx = vload(s);
        for (int j = VL; j < BN; j += VL) {
            vf x = vload(s + j);
            mx = x > mx ? x : mx;
        }
        const float bmax = hmax(mx);
        float* o = Ot + static_cast<int64_t>(r) * Dp;
        if (bmax == NEG_INF) {  // nothing valid for this row in this block ...
            // ... unless a NaN logit hid from the max (comparisons drop NaN lanes): then go on, and
            // e^{NaN} poisons l and o (a NaN row), as the contract asks.
            bool nan = false;
            for (int j = 0; j < BN; ++j) nan |= s[j] != s[j];
            if (!nan) {
                std::memset(s, 0, sizeof(float) * BN);
                continue;
            }
        }
        if (bmax > m[r]) {  // strictly greater: earlier blocks win ties
            if (want[r]) {
                int j = 0;
                while (s[j] != bmax) ++j;
                am[r] = j0 + j;
            }
            if (m[r] != NEG_INF) {
                const float alpha = std::exp(m[r] - bmax);
                l[r] *= alpha;
                const vf av = vbroadcast(alpha);
                for (int d = 0; d < Dp; d += VL) vstore(o + d, vload(o + d) * av);
            }
            m[r] = bmax;
        }
        const vf mv = vbroadcast(m[r]);
        vf sum = vf{};
        for (int j = 0; j < BN; j += VL) {
            vf p = vexp(vload(s + j) - mv);
            vstore(s + j, p);
            sum += p;
        }
        l[r] += hsum(sum);
    }
}

// ---- split-key decode ---------------------------------------------------------------------------------
// A decode call (M == 1) has one work item per (batch, kv head with an active head): fewer items than
// threads on models with few KV heads (SmolLM2 has 3, Gemma 3 one), so threads idle while one item streams
// its keys from memory. split_keys cuts every item at fixed key positions (multiples of kSplitKeys rounded
// up to whole key blocks: the cuts depend on the call's N and window only, never on the batch, the threads or the head mask) into
// pieces that run as items of their own and leave each row's partial state (running max, sum, argmax and
// unnormalised accumulator); merge_pieces combines a row's pieces and stores the row. A call whose keys
// fit in one piece is not split and computes exactly as before.
constexpr int64_t kSplitKeys = 256;

inline void split_keys(const Args& a, Plan& plan) {
    if (a.M != 1 || plan.items.empty()) return;
    // The one row sits at N - 1: it sees keys [N - window, N) with a window, else all N.
    const int64_t key_begin = a.window ? std::max<int64_t>(0, a.N - a.window) : 0, key_end = a.N;
    // Cuts on key-block boundaries, so that no block is visited by two pieces.
    const int64_t C = (kSplitKeys + a.block_n - 1) / a.block_n * a.block_n;
    const int64_t first_cut = (key_begin / C + 1) * C;
    if (first_cut >= key_end) return;
    const int64_t pieces = plan.pieces = 2 + (key_end - first_cut - 1) / C;
    const int64_t sinks = sink_end(a, a.N - 1);  // visited by the first piece only (for_each_item)
    const int64_t keys = key_end - first_block_key(a, a.N - 1) + sinks;  // the keys make_plan costed an item by
    // A decode call's time is reading its keys and values, which an active KV group does once however many
    // of its heads are active: its work counts all g heads of every active group (an unmasked call's work
    // unchanged, a masked one's as the unmasked call that reads the same memory) for the thread threshold.
    plan.work = static_cast<int64_t>(plan.items.size()) * keys * plan.g * a.D;
    plan.whole = std::move(plan.items);
    plan.items.clear();
    plan.items.reserve(plan.whole.size() * pieces);
    for (size_t w = 0; w < plan.whole.size(); ++w) {
        const Item& it = plan.whole[w];
        const int64_t active = it.cost / keys;
        for (int64_t p = 0; p < pieces; ++p) {
            const int64_t k0 = p == 0 ? key_begin : first_cut + (p - 1) * C;
            const int64_t k1 = std::min(key_end, first_cut + p * C);
            plan.items.push_back({it.b, it.hkv, it.i0, it.i1, (k1 - k0 + (p == 0 ? sinks : 0)) * active, k0, k1,
                                  static_cast<int64_t>(w) * pieces + p});
        }
    }
    std::stable_sort(plan.items.begin(), plan.items.end(),
                     [](const Item& x, const Item& y) { return x.cost > y.cost; });
}

// Partial states of the pieces' rows, slot-major: slot s = whole item * pieces + piece, row r of it at
// s * rows + r (the accumulator: Dp floats from there).
struct Partials {
    int64_t rows;
    int Dp;
    std::vector<float> m, l, o;
    std::vector<int64_t> am;
    Partials(const Plan& plan, int Dp_)
        : rows(plan.max_rows), Dp(Dp_), m(plan.whole.size() * plan.pieces * rows),
          l(m.size()), o(m.size() * Dp_), am(m.size()) {}
};

// Every split row: with m = max_p m_p over its pieces, sum = sum_p l_p e^{m_p - m} and accumulator
// sum_p o_p e^{m_p - m}, then stored (store_row, which adds a sink). The argmax is that of the first piece
// (in key order) whose max is m, so ties keep the smallest key index as in one pass. A piece that met a
// NaN / +inf logit has a NaN sum, which survives the weighting: the row comes out NaN with argmax -1.
template <class E>
void merge_pieces(const Args& a, const Plan& plan, const Partials& part, int threads) {
    const int64_t n_whole = static_cast<int64_t>(plan.whole.size()), P = plan.pieces, Dp = part.Dp;
    std::vector<float> scratch(static_cast<size_t>(threads) * Dp);  // allocated outside the region
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t w = 0; w < n_whole; ++w) {
        const Item& it = plan.whole[w];
        float* o = scratch.data() + static_cast<int64_t>(thread_num()) * Dp;
        int64_t r = 0;
        for (int64_t h = it.hkv * plan.g; h < (it.hkv + 1) * plan.g; ++h) {
            if (a.skip && a.skip[it.b * a.Hq + h]) continue;
            const auto at = [&](int64_t p) { return (w * P + p) * part.rows + r; };
            float mx = NEG_INF;
            for (int64_t p = 0; p < P; ++p) mx = part.m[at(p)] > mx ? part.m[at(p)] : mx;
            float sum = 0.f;
            int64_t am = -1;
            std::memset(o, 0, sizeof(float) * Dp);
            for (int64_t p = 0; p < P; ++p) {
                const float mp = part.m[at(p)];
                if (am < 0 && mp == mx && mx != NEG_INF) am = part.am[at(p)];
                const float wgt = mp == mx ? 1.f : std::exp(mp - mx);  // all -inf: 1, sums 0 (or NaN) kept
                sum += part.l[at(p)] * wgt;
                const float* op = part.o.data() + at(p) * Dp;
                for (int64_t d = 0; d < Dp; ++d) o[d] += op[d] * wgt;
            }
            const bool want = a.argmax && a.T;
            store_row<E>(a, it.b, h, it.i0, o, 1, mx, sum, want, am);
            ++r;
        }
    }
}

// ---- row-major tiles (decode) ------------------------------------------------------------------------

template <class E>
void run_rows(const Args& a, const Plan& plan, int threads) {
    using T = typename E::T;
    using namespace rowmajor;
    const T* k = static_cast<const T*>(a.k);
    const T* v = static_cast<const T*>(a.v);
    const int64_t D = a.D;
    const int BN = a.block_n;
    const int Dp = static_cast<int>(round_up(D, VL));
    const int64_t max_rows = plan.max_rows;
    const bool convert_k = !std::is_same_v<E, F32> || a.ks[3] != 1;
    struct Bufs {
        float *Qt, *Ot, *S, *Kbuf, *Vp, *m, *l, *kbias;
        int64_t *am, *pos;
        uint8_t* want;
    };
    const auto carve = [&](Carve& c) RETMASK_LAMBDA_INLINE {
        return Bufs{c.take<float>(max_rows * Dp), c.take<float>(max_rows * Dp), c.take<float>(max_rows * BN),
                    c.take<float>(convert_k ? BN * D : 0), c.take<float>(BN * Dp), c.take<float>(max_rows),
                    c.take<float>(max_rows), c.take<float>(BN), c.take<int64_t>(max_rows),
                    c.take<int64_t>(max_rows), c.take<uint8_t>(max_rows)};
    };
    Partials part(plan, Dp);  // empty unless split_keys split the call; allocated outside the region
    for_each_item(a, plan, threads, carve, [&](const Bufs& buf, const Tile& t) RETMASK_LAMBDA_INLINE {
        float *const Qt = buf.Qt, *const Ot = buf.Ot, *const S = buf.S, *const Vp = buf.Vp;
        float *const m = buf.m, *const l = buf.l, *const kbias = buf.kbias;
        int64_t *const am = buf.am, *const pos = buf.pos;
        uint8_t* const want = buf.want;
        const int64_t b = t.b;
        const int R = t.R;
        start_rows(a, t, Ot, Dp, m, l, am, pos, want);
        for (int r = 0; r < R; ++r) load_q_row<E>(a, b, t.row_h[r], t.row_i[r], Qt + static_cast<int64_t>(r) * Dp, 1);
        const T* kb = k + b * a.ks[0] + t.hk * a.ks[1];
        const T* vb = v + b * a.vs[0] + t.hk * a.vs[1];

        for_each_key_block(a, plan, t, [&](int64_t j0, int nj, uint8_t st) RETMASK_LAMBDA_INLINE {
            // K rows in fp32 (in place when possible); V packed [BN][Dp], rows past nj zero.
            int64_t ldk;
            const float* Kr = rows_fp32<E>(kb, a.ks, j0, nj, D, buf.Kbuf, &ldk);
            for (int j = 0; j < nj; ++j) {
                const T* vr = vb + (j0 + j) * a.vs[2];
                float* vp = Vp + static_cast<int64_t>(j) * Dp;
                if (a.vs[3] == 1) {
                    for (int64_t d = 0; d < D; ++d) vp[d] = E::load(vr + d);
                } else {
                    for (int64_t d = 0; d < D; ++d) vp[d] = E::load(vr + d * a.vs[3]);
                }
            }
            if (nj < BN) std::memset(Vp + static_cast<int64_t>(nj) * Dp, 0, sizeof(float) * (BN - nj) * Dp);

            qk_dot(Qt, Dp, R, Kr, ldk, static_cast<int>(D), S, BN, nj);
            if (a.softcap > 0.f) softcap_block(S, static_cast<int64_t>(R) * BN, a.softcap, a.cap_inv, a.cap_post);

            softmax_rows(a, t, j0, nj, st, S, BN, Ot, Dp, m, l, am, pos, want, kbias);

            pv_rows<MR_PV>(S, BN, Vp, Dp, Ot, Dp, Dp, nj, R);
        });

        if (t.part >= 0) {  // a piece of a split row: its partial state, for merge_pieces
            for (int r = 0; r < R; ++r) {
                const int64_t at = t.part * part.rows + r;
                part.m[at] = m[r];
                part.l[at] = l[r];
                part.am[at] = am[r];
                std::memcpy(part.o.data() + at * Dp, Ot + static_cast<int64_t>(r) * Dp, sizeof(float) * Dp);
            }
            return;
        }
        for (int r = 0; r < R; ++r)
            store_row<E>(a, b, t.row_h[r], t.row_i[r], Ot + static_cast<int64_t>(r) * Dp, 1, m[r], l[r], want[r],
                         am[r]);
    });
    if (!plan.whole.empty()) merge_pieces<E>(a, plan, part, threads);
}

// ---- lanes tiles (prefill) ---------------------------------------------------------------------------

// dst[p * step] = (q[2p], q[2p+1]) of row (b, h, i) as bf16 pairs, unscaled (the bf16dot layout scales
// the logits instead: the pairs are the input's own bits).
RETMASK_INLINE void load_q_pairs(const Args& a, int64_t b, int64_t h, int64_t i, int32_t* dst, int64_t step) {
    const uint16_t* qp = static_cast<const uint16_t*>(a.q) + b * a.qs[0] + h * a.qs[1] + i * a.qs[2];
    for (int64_t p = 0; p < a.D / 2; ++p)
        dst[p * step] = static_cast<int32_t>(static_cast<uint32_t>(qp[2 * p * a.qs[3]]) |
                                             static_cast<uint32_t>(qp[(2 * p + 1) * a.qs[3]]) << 16);
}

// Dot (bfloat16 only): both block products as bf16 dot products (Qp, K words, Pp, Vp; see qk_tile_dot),
// the rest as in the fp32 lanes layout.
template <class E, bool Dot = false>
void run_lanes(const Args& a, const Plan& plan, int threads) {
    static_assert(!Dot || std::is_same_v<E, BF16>, "bf16 dot products are for bfloat16 inputs");
    using T = typename E::T;
    const T* k = static_cast<const T*>(a.k);
    const T* v = static_cast<const T*>(a.v);
    const int64_t M = a.M, N = a.N, D = a.D, T_ = a.T;
    const int BN = a.block_n;
    const int Di = static_cast<int>(D);
    const int64_t max_rp = round_up(plan.max_rows, VL);
    // fp32 blocks are copied too from D = 128 on: a block then sits in a buffer reused at one address
    // (L1/L2-resident, no TLB walks over the whole K/V), which made bf16 calls 15% faster than fp32 ones
    // at D = 128; at D = 64 reading in place ties.
    const bool copy_fp32 = D >= 128;
    const bool convert = !Dot && (!std::is_same_v<E, F32> || a.ks[3] != 1 || a.vs[3] != 1 || copy_fp32);
    // bf16dot: K rows are read in place as words when their dims are contiguous, else copied (Kh).
    const bool copy_k = Dot && a.ks[3] != 1;
    struct Bufs {
        float *Qt, *Ot, *St, *m, *l;
        int32_t *am, *pos, *want;
        float *Kbuf, *Vbuf;
        int32_t *Qp, *Pp;
        uint32_t* Vp;
        uint16_t* Kh;
    };
    const auto carve = [&](Carve& c) RETMASK_LAMBDA_INLINE {
        return Bufs{c.take<float>(Dot ? 0 : D * max_rp), c.take<float>(D * max_rp), c.take<float>(BN * max_rp),
                    c.take<float>(max_rp),                c.take<float>(max_rp),     c.take<int32_t>(max_rp),
                    c.take<int32_t>(max_rp),              c.take<int32_t>(max_rp),   c.take<float>(convert ? BN * D : 0),
                    c.take<float>(convert ? BN * D : 0),  c.take<int32_t>(Dot ? D / 2 * max_rp : 0),
                    c.take<int32_t>(Dot ? BN / 2 * max_rp : 0), c.take<uint32_t>(Dot ? BN / 2 * D : 0),
                    c.take<uint16_t>(copy_k ? BN * D : 0)};
    };
    for_each_item(a, plan, threads, carve, [&](const Bufs& buf, const Tile& t) RETMASK_LAMBDA_INLINE {
        float *const Qt = buf.Qt, *const Ot = buf.Ot, *const St = buf.St, *const m = buf.m, *const l = buf.l;
        int32_t *const am = buf.am, *const pos = buf.pos, *const want = buf.want;
        const int64_t b = t.b;
        const int R = t.R;
        // Tile rows padded to RP (a multiple of VL): padding rows see no key and hold zeros.
        const int RP = (R + VL - 1) / VL * VL;
        for (int r = 0; r < RP; ++r) {
            const bool real = r < R;
            pos[r] = real ? static_cast<int32_t>(N - M + t.row_i[r]) : -1;  // padding rows see nothing
            want[r] = real && a.argmax && T_ && t.row_i[r] >= M - T_ ? -1 : 0;
            m[r] = NEG_INF;
            l[r] = 0.f;
            am[r] = -1;
            if constexpr (Dot) {
                if (real) {
                    load_q_pairs(a, b, t.row_h[r], t.row_i[r], buf.Qp + r, RP);
                } else {
                    for (int64_t p = 0; p < D / 2; ++p) buf.Qp[p * RP + r] = 0;
                }
            } else if (real) {
                load_q_row<E>(a, b, t.row_h[r], t.row_i[r], Qt + r, RP);
            } else {
                for (int64_t d = 0; d < D; ++d) Qt[d * RP + r] = 0.f;
            }
        }
        std::memset(Ot, 0, sizeof(float) * D * RP);
        const T* kb = k + b * a.ks[0] + t.hk * a.ks[1];
        const T* vb = v + b * a.vs[0] + t.hk * a.vs[1];
        const int NV = RP / VL;
        const int64_t min_pos = t.min_pos;

        for_each_key_block(a, plan, t, [&](int64_t j0, int nj, uint8_t st) RETMASK_LAMBDA_INLINE {
            int64_t ldk = 0, ldv = 0;
            const float *Kr = nullptr, *Vr = nullptr;
            if constexpr (Dot) {
                const uint16_t* Kw = kb + j0 * a.ks[2];
                ldk = a.ks[2];
                if (copy_k) {
                    for (int j = 0; j < nj; ++j)
                        for (int64_t d = 0; d < D; ++d) buf.Kh[j * D + d] = kb[(j0 + j) * a.ks[2] + d * a.ks[3]];
                    Kw = buf.Kh;
                    ldk = D;
                }
                key_pairs(vb, a.vs, j0, nj, D, buf.Vp);
                qk_block_dot(Kw, ldk, buf.Qp, RP, St, Di / 2, nj, a.scale);
            } else {
                Kr = rows_fp32<E>(kb, a.ks, j0, nj, D, buf.Kbuf, &ldk, copy_fp32);
                Vr = rows_fp32<E>(vb, a.vs, j0, nj, D, buf.Vbuf, &ldv, copy_fp32);
                qk_block(Kr, ldk, Qt, RP, St, Di, nj);
            }
            if (a.softcap > 0.f) softcap_block(St, static_cast<int64_t>(nj) * RP, a.softcap, a.cap_inv, a.cap_post);

            // Masks: padded keys -> -inf rows; future keys (causal) and keys before the window -> -inf per lane.
            if (st == 1)
                for (int j = 0; j < nj; ++j)
                    if (!a.kpm[b * N + j0 + j])
                        for (int c = 0; c < NV; ++c) vstore(St + j * RP + c * VL, vbroadcast(NEG_INF));
            if (a.causal && j0 + nj - 1 > min_pos) {
                for (int j = static_cast<int>(std::max<int64_t>(0, min_pos + 1 - j0)); j < nj; ++j) {
                    const int32_t key = static_cast<int32_t>(j0 + j);
                    for (int c = 0; c < NV; ++c) {
                        const vi p = *reinterpret_cast<const vi*>(pos + c * VL);
                        float* s = St + j * RP + c * VL;
                        vstore(s, p < key ? vbroadcast(NEG_INF) : vload(s));
                    }
                }
            }
            if (a.window && j0 < t.win_edge) {  // key j is outside row r's window when pos[r] - j >= window
                const int jend = static_cast<int>(std::min<int64_t>(nj, t.win_edge - j0));
                const vi w = vi{} + static_cast<int32_t>(a.window);
                // sink tokens (keys < a.sink) stay visible outside the window
                for (int j = static_cast<int>(std::clamp<int64_t>(a.sink - j0, 0, jend)); j < jend; ++j) {
                    const vi key = vi{} + static_cast<int32_t>(j0 + j);
                    for (int c = 0; c < NV; ++c) {
                        const vi p = *reinterpret_cast<const vi*>(pos + c * VL);
                        float* s = St + j * RP + c * VL;
                        vstore(s, p - key >= w ? vbroadcast(NEG_INF) : vload(s));
                    }
                }
            }

            for (int c = 0; c < NV; ++c) {
                const int off = c * VL;
                vf bmax = vload(St + off);
                for (int j = 1; j < nj; ++j) {
                    const vf x = vload(St + j * RP + off);
                    bmax = x > bmax ? x : bmax;
                }
                const vf mold = vload(m + off);
                const vi better = bmax > mold;  // strictly: earlier blocks win ties
                const vi wantv = *reinterpret_cast<const vi*>(want + off);
                bool any_arg = false;
                for (int u = 0; u < VL; ++u) any_arg |= (better[u] & wantv[u]) != 0;
                if (any_arg) {  // first key in the block reaching the block max, per lane
                    vi idx = vi{} + nj;
                    for (int j = nj - 1; j >= 0; --j) idx = vload(St + j * RP + off) == bmax ? vi{} + j : idx;
                    vi amv = *reinterpret_cast<const vi*>(am + off);
                    amv = (better & wantv) ? idx + static_cast<int32_t>(j0) : amv;
                    *reinterpret_cast<vi*>(am + off) = amv;
                }
                const vf mnew = better ? bmax : mold;
                // exp(-inf - -inf) would be NaN: rows with nothing valid so far subtract 0 instead.
                const vf msafe = mnew == vbroadcast(NEG_INF) ? vf{} : mnew;
                const vf alpha = vexp(mold - msafe);
                vstore(m + off, mnew);
                vf sum = vf{};
                if constexpr (Dot) {  // P as bf16 pairs of keys; the sum of the unrounded P, as SDPA sums
                    for (int j = 0; j < nj; j += 2) {
                        const vf p0 = vexp(vload(St + j * RP + off) - msafe);
                        const vf p1 = j + 1 < nj ? vexp(vload(St + (j + 1) * RP + off) - msafe) : vf{};
                        sum += p0;
                        sum += p1;
                        vistore(buf.Pp + (j / 2) * RP + off, pack_pairs(p0, p1));
                    }
                } else {
                    for (int j = 0; j < nj; ++j) {
                        float* s = St + j * RP + off;
                        const vf p = vexp(vload(s) - msafe);
                        vstore(s, p);
                        sum += p;
                    }
                }
                vstore(l + off, vload(l + off) * alpha + sum);
                bool changed = false;
                for (int u = 0; u < VL; ++u) changed |= better[u] != 0;
                if (changed) {
                    for (int64_t d = 0; d < D; ++d) vstore(Ot + d * RP + off, vload(Ot + d * RP + off) * alpha);
                }
            }

            if constexpr (Dot)
                pv_block_dot(buf.Vp, D, buf.Pp, RP, Ot, Di, (nj + 1) / 2);
            else
                pv_block(Vr, ldv, St, RP, Ot, Di, nj);
        });

        for (int r = 0; r < R; ++r)
            store_row<E>(a, b, t.row_h[r], t.row_i[r], Ot + r, RP, m[r], l[r], want[r] != 0, am[r]);
    });
}

// bf16 dot products in the lanes layout when asked (bfloat16, whatever the tile size); else the lanes path when a tile fills at least one VL-row vector,
// the row-major path otherwise (decode). Calls too small to split run on the calling
// thread; others on `threads` threads, at most one per work item.
template <class E>
void run(const Args& a, int threads) {
    Plan plan = make_plan<E>(a);
    bool lanes_dot = false;
    if constexpr (std::is_same_v<E, BF16>) lanes_dot = a.bf16_dot;
    if (!lanes_dot && plan.max_rows < VL) split_keys(a, plan);  // the row-major layout's decode
    threads = plan.parallel() ? static_cast<int>(std::min<int64_t>(threads, plan.items.size())) : 1;
    if constexpr (std::is_same_v<E, BF16>) {
        // Always the lanes layout, tiles of fewer rows padded to a vector: a row's arithmetic then never
        // depends on how many rows share its tile, so skipping a head changes no other head's output.
        if (a.bf16_dot) {
            run_lanes<E, true>(a, plan, threads);
            return;
        }
    }
    if (plan.max_rows >= VL)
        run_lanes<E>(a, plan, threads);
    else
        run_rows<E>(a, plan, threads);
}

}  // namespace

void run(const KernelArgs& a, DType dtype, int threads) {
    by_dtype(dtype, [&](auto e) { run<decltype(e)>(a, threads); });
}

}  // namespace retmask::detail::RETMASK_ISA
