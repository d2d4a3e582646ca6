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
// (dot products along D, rows in registers; decode-sized tiles). Exported with a plain C ABI,
// called through ctypes with data pointers and element strides. fp16/bf16 are converted to fp32 on
// load; all accumulation is fp32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// 16 fp32 lanes; GCC lowers this to one zmm (AVX-512), two ymm (AVX2) or four xmm registers.
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));  // unaligned access
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int VL = 16;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline vf vload(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void vstore(float* p, vf x) { *reinterpret_cast<vf*>(p) = x; }
inline vf vloadu(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline vf vbroadcast(float x) { return vf{} + x; }

// exp(x) for x <= 0 (softmax arguments). Cephes-style: 2^n * p(r), |rel err| ~ 2e-7.
// Arguments below -87 (incl. -inf of masked keys) give exactly 0.
inline vf vexp(vf x) {
    const vf lo = vbroadcast(-87.0f);
    vf xc = x < lo ? lo : x;
    vf t = xc * 1.44269504088896341f;
    const vf magic = vbroadcast(12582912.0f);  // 1.5 * 2^23: round to nearest integer
    vf n = (t + magic) - magic;
    vf r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = vbroadcast(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    std::memcpy(&scale, &e, sizeof(scale));
    vf res = p * scale;
    return x < lo ? vf{} : res;
}

inline float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < VL; ++i) m = std::max(m, x[i]);
    return m;
}
inline float hsum(vf x) {  // fixed pairwise order: 16 -> 8 -> 4 -> 2 -> 1
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
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

// ---- micro-kernels ---------------------------------------------------------------------------------
// The tile is kept transposed so that query rows live in vector lanes: Qt [D][RP], St [BN][RP],
// Ot [D][RP] (RP = rows rounded up to 16). K and V are read row-major straight from the input (or a
// converted fp32 copy) and broadcast one scalar at a time, so nothing is transposed and the softmax
// (max, exp, sum, argmax, rescale) is element-wise over rows with no horizontal reductions.

// St[j][r] = sum_d K[j][d] * Qt[d][r] for NJ keys x RV*16 rows. Every logit is the same FMA chain
// over d = 0..D-1 whatever its position in a tile, so duplicate keys give bit-identical logits and
// ties resolve to the smallest index, as in torch.
template <int NJ, int RV>
inline void qk_tile(const float* __restrict K, int64_t ldk, const float* __restrict Qt, int RP,
                    float* __restrict St, int D) {
    vf acc[NJ][RV];
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) acc[j][c] = vf{};
    for (int d = 0; d < D; ++d) {
        vf qv[RV];
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) qv[c] = vload(Qt + d * RP + c * VL);
#pragma GCC unroll 8
        for (int j = 0; j < NJ; ++j) {
            const vf kb = vbroadcast(K[j * ldk + d]);
#pragma GCC unroll 4
            for (int c = 0; c < RV; ++c) acc[j][c] += kb * qv[c];
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) vstore(St + j * RP + c * VL, acc[j][c]);
}

// Ot[d][r] += sum_j V[j][d] * P[j][r] for ND head dims x RV*16 rows, keys j < nj.
template <int ND, int RV>
inline void pv_tile(const float* __restrict V, int64_t ldv, const float* __restrict P, int RP,
                    float* __restrict Ot, int nj) {
    vf acc[ND][RV];
#pragma GCC unroll 8
    for (int d = 0; d < ND; ++d)
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) acc[d][c] = vload(Ot + d * RP + c * VL);
    for (int j = 0; j < nj; ++j) {
        vf pv[RV];
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) pv[c] = vload(P + j * RP + c * VL);
#pragma GCC unroll 8
        for (int d = 0; d < ND; ++d) {
            const vf vb = vbroadcast(V[j * ldv + d]);
#pragma GCC unroll 4
            for (int c = 0; c < RV; ++c) acc[d][c] += vb * pv[c];
        }
    }
#pragma GCC unroll 8
    for (int d = 0; d < ND; ++d)
#pragma GCC unroll 4
        for (int c = 0; c < RV; ++c) vstore(Ot + d * RP + c * VL, acc[d][c]);
}

constexpr int NJ_QK = 6;  // 6 keys x 4 row vectors = 24 accumulators (of 32 zmm registers)
constexpr int ND_PV = 6;  // 6 head dims x 4 row vectors = 24 accumulators
constexpr int RV_MAX = 4;

// Forced inlining keeps the dispatch helpers and their lambdas out of the generated code: the loops
// below compile to what hand-written switch statements give (checked with bench/bench_kernel_ab.py).
#define RETMASK_INLINE inline __attribute__((always_inline))
#define RETMASK_LAMBDA_INLINE __attribute__((always_inline))

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

// ---- row-major path (few rows per tile: decode) --------------------------------------------------
// For tiles with fewer than 16 rows (decode, M = 1), where the lanes path would leave lanes idle:
// logits as dot products along D (K read in place), then O += P V with rows in registers and head
// dims in vector lanes (V packed [BN][Dp] per block).
namespace rowmajor {
// O[r][d] += sum_j P[r][j] * V[j][d] for MR rows, NV*16 output columns starting at column d0.
// P: [MR][BN], V: [BN][ldv], O: [MR][ldo]; only the first nj keys are read.
template <int MR, int NV>
inline void pv_tile(const float* __restrict P, int BN, const float* __restrict V, int ldv, float* __restrict O,
                    int ldo, int nj) {
    vf acc[MR][NV];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) acc[r][c] = vload(O + r * ldo + c * VL);
    for (int j = 0; j < nj; ++j) {
        vf vv[NV];
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) vv[c] = vload(V + j * ldv + c * VL);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            vf p = vbroadcast(P[r * BN + j]);
#pragma GCC unroll 4
            for (int c = 0; c < NV; ++c) acc[r][c] += p * vv[c];
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) vstore(O + r * ldo + c * VL, acc[r][c]);
}

constexpr int MR_PV = 8;  // 8 rows x 32 columns = 16 accumulators

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
// no transpose); S[r][nj..BN) = 0. Decode tiles have 1-15 rows, too few to amortise packing K^T.
// Every logit is the same chain (16-lane FMAs, fixed-order lane sum, scalar tail), so duplicate keys
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

// ---- the forward ---------------------------------------------------------------------------------

struct Args {
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
};

struct Item {
    int64_t b, hkv, i0, i1;  // query rows [i0, i1)
    int64_t cost;
};

inline float* aligned_floats(size_t n) {
    size_t bytes = ((n * sizeof(float) + 63) / 64) * 64;
    void* p = std::aligned_alloc(64, bytes ? bytes : 64);
    if (p) std::memset(p, 0, bytes);
    return static_cast<float*>(p);
}

// K or V rows [j0, j0 + nj) of one (batch, kv head) as fp32 rows: the input itself when it already is
// contiguous fp32 along D, else a converted copy in buf [nj][D].
template <class E>
const float* rows_fp32(const typename E::T* base, const int64_t* st, int64_t j0, int nj, int64_t D,
                       float* buf, int64_t* ld) {
    if constexpr (std::is_same_v<E, F32>) {
        if (st[3] == 1) {
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

struct Plan {
    int64_t g, nblk;
    int64_t max_rows = 0;  // most tile rows of any item (scratch size)
    int64_t work = 0;      // sum over items of keys x rows x D (~ multiply-adds of QK^T)
    // Below this the call runs on one thread: waking a second one costs more than it saves (and on a
    // busy machine it can cost milliseconds: the scheduler must find it a core). ~0.1-0.2 ms of work.
    static constexpr int64_t kParallelWork = int64_t(1) << 21;
    bool parallel() const { return work >= kParallelWork && items.size() > 1; }
    std::vector<uint8_t> blk_state;  // per batch, per key block: 0 none valid, 1 some, 2 all
    std::vector<Item> items;         // sorted by causal cost, largest first
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
            // group still fills the vector lanes (64 rows = 4 full vectors for 1, 2 or 4 heads).
            const int64_t bm = std::max<int64_t>(1, a.block_m / active);
            plan.max_rows = std::max(plan.max_rows, active * std::min(bm, M));
            for (int64_t i0 = 0; i0 < M; i0 += bm) {
                int64_t i1 = std::min(M, i0 + bm);
                int64_t keys = a.causal ? N - M + i1 : N;
                items.push_back({b, hk, i0, i1, keys * active * (i1 - i0)});
            }
        }
    std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
    for (const Item& it : items) plan.work += it.cost * D;
    return plan;
}


template <class E>
int run_rows(const Args& a, const Plan& plan) {
    using T = typename E::T;
    const T* q = static_cast<const T*>(a.q);
    const T* k = static_cast<const T*>(a.k);
    const T* v = static_cast<const T*>(a.v);
    T* out = static_cast<T*>(a.out);
    const int64_t Hq = a.Hq, M = a.M, N = a.N, D = a.D, T_ = a.T;
    const int BN = a.block_n;
    const int64_t g = plan.g, nblk = plan.nblk;
    const std::vector<uint8_t>& blk_state = plan.blk_state;
    const std::vector<Item>& items = plan.items;
    const int64_t n_items = static_cast<int64_t>(items.size());
    int failed = 0;
    const int Dp = static_cast<int>((D + VL - 1) / VL * VL);
    using namespace rowmajor;
#pragma omp parallel if (plan.parallel())
    {
        const int max_rows = static_cast<int>(plan.max_rows);
        float* Qt = aligned_floats(static_cast<size_t>(max_rows) * Dp);
        float* Ot = aligned_floats(static_cast<size_t>(max_rows) * Dp);
        float* S = aligned_floats(static_cast<size_t>(max_rows) * BN);
        const bool convert_k = !std::is_same_v<E, F32> || a.ks[3] != 1;
        float* Kbuf = convert_k ? aligned_floats(static_cast<size_t>(BN) * D) : nullptr;
        float* Vp = aligned_floats(static_cast<size_t>(BN) * Dp);
        std::vector<float> m(max_rows), l(max_rows);
        std::vector<int64_t> am(max_rows), pos(max_rows), row_h(max_rows), row_i(max_rows);
        std::vector<uint8_t> want(max_rows);
        std::vector<float> kbias(BN);
        if (!Qt || !Ot || !S || (convert_k && !Kbuf) || !Vp) {
#pragma omp atomic write
            failed = 1;
        }

#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; ++it) {
            if (failed) continue;
            const Item& w = items[it];
            const int64_t b = w.b, hk = w.hkv;
            // Tile rows: active heads of this kv group x query rows [i0, i1).
            int R = 0;
            for (int64_t h = hk * g; h < (hk + 1) * g; ++h) {
                if (a.skip && a.skip[b * Hq + h]) continue;
                for (int64_t i = w.i0; i < w.i1; ++i, ++R) {
                    row_h[R] = h;
                    row_i[R] = i;
                    pos[R] = N - M + i;
                    want[R] = a.argmax && T_ && i >= M - T_;
                    const T* qp = q + b * a.qs[0] + h * a.qs[1] + i * a.qs[2];
                    float* qt = Qt + static_cast<int64_t>(R) * Dp;
                    for (int64_t d = 0; d < D; ++d) qt[d] = E::load(qp + d * a.qs[3]) * a.scale;
                    m[R] = NEG_INF;
                    l[R] = 0.f;
                    am[R] = -1;
                    std::memset(Ot + static_cast<int64_t>(R) * Dp, 0, sizeof(float) * Dp);
                }
            }
            const int64_t min_pos = N - M + w.i0, max_pos = N - M + w.i1 - 1;
            const int64_t key_end = a.causal ? max_pos + 1 : N;
            const T* kb = k + b * a.ks[0] + hk * a.ks[1];
            const T* vb = v + b * a.vs[0] + hk * a.vs[1];

            for (int64_t j0 = 0; j0 < key_end; j0 += BN) {
                const int64_t jb = j0 / BN;
                const uint8_t st = a.kpm ? blk_state[b * nblk + jb] : 2;
                if (st == 0) continue;  // no valid key in this block (e.g. left padding)
                const int nj = static_cast<int>(std::min<int64_t>(BN, key_end - j0));
                // K rows in fp32 (in place when possible); V packed [BN][Dp], rows past nj zero.
                int64_t ldk;
                const float* Kr = rows_fp32<E>(kb, a.ks, j0, nj, D, Kbuf, &ldk);
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

                // Key validity bias for this block: 0 or -inf (padding, tail past key_end).
                const bool need_bias = st == 1 || nj < BN;
                if (need_bias)
                    for (int j = 0; j < BN; ++j)
                        kbias[j] = (j < nj && (!a.kpm || a.kpm[b * N + j0 + j])) ? 0.f : NEG_INF;
                const bool diag = a.causal && j0 + BN - 1 > min_pos;

                for (int r = 0; r < R; ++r) {
                    float* s = S + static_cast<int64_t>(r) * BN;
                    if (need_bias)
                        for (int j = 0; j < BN; j += VL) vstore(s + j, vload(s + j) + vload(kbias.data() + j));
                    if (diag) {
                        const int64_t lim = pos[r] - j0;  // keys j > lim are in the future
                        for (int64_t j = std::max<int64_t>(0, lim + 1); j < BN; ++j) s[j] = NEG_INF;
                    }
                    vf mx = vload(s);
                    for (int j = VL; j < BN; j += VL) {
                        vf x = vload(s + j);
                        mx = x > mx ? x : mx;
                    }
                    const float bmax = hmax(mx);
                    float* o = Ot + static_cast<int64_t>(r) * Dp;
                    if (bmax == NEG_INF) {  // nothing valid for this row in this block
                        std::memset(s, 0, sizeof(float) * BN);
                        continue;
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

                pv_rows<MR_PV>(S, BN, Vp, Dp, Ot, Dp, Dp, nj, R);
            }

            // Normalise and write out; rows that never saw a valid key give 0 and -1.
            for (int r = 0; r < R; ++r) {
                const int64_t h = row_h[r], i = row_i[r];
                T* op = out + b * a.os[0] + h * a.os[1] + i * a.os[2];
                const float* o = Ot + static_cast<int64_t>(r) * Dp;
                const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
                for (int64_t d = 0; d < D; ++d) E::store(op + d * a.os[3], o[d] * inv);
                if (want[r]) a.argmax[(b * Hq + h) * T_ + (i - (M - T_))] = l[r] > 0.f ? am[r] : -1;
            }
        }
        std::free(Qt);
        std::free(Ot);
        std::free(S);
        std::free(Kbuf);
        std::free(Vp);
    }
    return failed ? 2 : 0;
}

template <class E>
int run_lanes(const Args& a, const Plan& plan) {
    using T = typename E::T;
    const T* q = static_cast<const T*>(a.q);
    const T* k = static_cast<const T*>(a.k);
    const T* v = static_cast<const T*>(a.v);
    T* out = static_cast<T*>(a.out);
    const int64_t Hq = a.Hq, M = a.M, N = a.N, D = a.D, T_ = a.T;
    const int BN = a.block_n;
    const int64_t g = plan.g, nblk = plan.nblk;
    const std::vector<uint8_t>& blk_state = plan.blk_state;
    const std::vector<Item>& items = plan.items;
    const int64_t n_items = static_cast<int64_t>(items.size());
    int failed = 0;
    const int Di = static_cast<int>(D);
#pragma omp parallel if (plan.parallel())
    {
        const int max_rp = static_cast<int>((plan.max_rows + VL - 1) / VL * VL);
        float* Qt = aligned_floats(static_cast<size_t>(D) * max_rp);
        float* Ot = aligned_floats(static_cast<size_t>(D) * max_rp);
        float* St = aligned_floats(static_cast<size_t>(BN) * max_rp);
        float* m = aligned_floats(max_rp);
        float* l = aligned_floats(max_rp);
        int32_t* am = reinterpret_cast<int32_t*>(aligned_floats(max_rp));
        int32_t* pos = reinterpret_cast<int32_t*>(aligned_floats(max_rp));
        int32_t* want = reinterpret_cast<int32_t*>(aligned_floats(max_rp));
        const bool convert = !std::is_same_v<E, F32> || a.ks[3] != 1 || a.vs[3] != 1;
        float* Kbuf = convert ? aligned_floats(static_cast<size_t>(BN) * D) : nullptr;
        float* Vbuf = convert ? aligned_floats(static_cast<size_t>(BN) * D) : nullptr;
        std::vector<int64_t> row_h(max_rp), row_i(max_rp);
        if (!Qt || !Ot || !St || !m || !l || !am || !pos || !want || (convert && (!Kbuf || !Vbuf))) {
#pragma omp atomic write
            failed = 1;
        }

#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; ++it) {
            if (failed) continue;
            const Item& w = items[it];
            const int64_t b = w.b, hk = w.hkv;
            // Tile rows: active heads of this kv group x query rows [i0, i1), padded to RP rows.
            int R = 0;
            for (int64_t h = hk * g; h < (hk + 1) * g; ++h) {
                if (a.skip && a.skip[b * Hq + h]) continue;
                for (int64_t i = w.i0; i < w.i1; ++i, ++R) {
                    row_h[R] = h;
                    row_i[R] = i;
                }
            }
            const int RP = (R + VL - 1) / VL * VL;
            for (int r = 0; r < RP; ++r) {
                const bool real = r < R;
                pos[r] = real ? static_cast<int32_t>(N - M + row_i[r]) : -1;  // padding rows see nothing
                want[r] = real && a.argmax && T_ && row_i[r] >= M - T_ ? -1 : 0;
                m[r] = NEG_INF;
                l[r] = 0.f;
                am[r] = -1;
                if (real) {
                    const T* qp = q + b * a.qs[0] + row_h[r] * a.qs[1] + row_i[r] * a.qs[2];
                    for (int64_t d = 0; d < D; ++d) Qt[d * RP + r] = E::load(qp + d * a.qs[3]) * a.scale;
                } else {
                    for (int64_t d = 0; d < D; ++d) Qt[d * RP + r] = 0.f;
                }
            }
            std::memset(Ot, 0, sizeof(float) * D * RP);
            const int64_t min_pos = N - M + w.i0, max_pos = N - M + w.i1 - 1;
            const int64_t key_end = a.causal ? max_pos + 1 : N;
            const T* kb = k + b * a.ks[0] + hk * a.ks[1];
            const T* vb = v + b * a.vs[0] + hk * a.vs[1];
            const int NV = RP / VL;

            for (int64_t j0 = 0; j0 < key_end; j0 += BN) {
                const uint8_t st = a.kpm ? blk_state[b * nblk + j0 / BN] : 2;
                if (st == 0) continue;  // no valid key in this block (e.g. left padding)
                const int nj = static_cast<int>(std::min<int64_t>(BN, key_end - j0));
                int64_t ldk, ldv;
                const float* Kr = rows_fp32<E>(kb, a.ks, j0, nj, D, Kbuf, &ldk);
                const float* Vr = rows_fp32<E>(vb, a.vs, j0, nj, D, Vbuf, &ldv);

                qk_block(Kr, ldk, Qt, RP, St, Di, nj);

                // Masks: padded keys -> -inf rows; future keys (causal) -> -inf per lane.
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
                    for (int t = 0; t < VL; ++t) any_arg |= (better[t] & wantv[t]) != 0;
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
                    for (int j = 0; j < nj; ++j) {
                        float* s = St + j * RP + off;
                        const vf p = vexp(vload(s) - msafe);
                        vstore(s, p);
                        sum += p;
                    }
                    vstore(l + off, vload(l + off) * alpha + sum);
                    bool changed = false;
                    for (int t = 0; t < VL; ++t) changed |= better[t] != 0;
                    if (changed) {
                        for (int64_t d = 0; d < D; ++d) vstore(Ot + d * RP + off, vload(Ot + d * RP + off) * alpha);
                    }
                }

                pv_block(Vr, ldv, St, RP, Ot, Di, nj);
            }

            // Normalise and write out; rows that never saw a valid key give 0 and -1.
            for (int r = 0; r < R; ++r) {
                const int64_t h = row_h[r], i = row_i[r];
                T* op = out + b * a.os[0] + h * a.os[1] + i * a.os[2];
                const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
                for (int64_t d = 0; d < D; ++d) E::store(op + d * a.os[3], Ot[d * RP + r] * inv);
                if (want[r]) a.argmax[(b * Hq + h) * T_ + (i - (M - T_))] = l[r] > 0.f ? am[r] : -1;
            }
        }
        std::free(Qt);
        std::free(Ot);
        std::free(St);
        std::free(m);
        std::free(l);
        std::free(am);
        std::free(pos);
        std::free(want);
        std::free(Kbuf);
        std::free(Vbuf);
    }
    return failed ? 2 : 0;
}

// Lanes path when a tile fills at least one 16-row vector, row-major path otherwise (decode).
template <class E>
int run(const Args& a) {
    const Plan plan = make_plan<E>(a);
    return plan.max_rows >= VL ? run_lanes<E>(a, plan) : run_rows<E>(a, plan);
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 for bad arguments, 2 if scratch memory could not be allocated.
// dtype: 0 = float32, 1 = float16, 2 = bfloat16 (q, k, v and out share it).
// Strides are in elements, [4] each for q [B,Hq,M,D], k/v [B,Hkv,N,D], out [B,Hq,M,D].
// argmax: int64 [B,Hq,T] contiguous (T = argmax_rows > 0) or null; key_padding_mask: uint8 [B,N]
// contiguous, 1 = valid, or null; skip_heads: uint8 [B,Hq] contiguous, 1 = skipped, or null.
// block_m: tile rows per work item (summed over the active heads of a kv group); block_n: keys per
// block, multiple of 32. num_threads <= 0 keeps the OpenMP default.
int retmask_attention_fwd_cpu(int dtype, const void* q, const int64_t* q_strides, const void* k,
                              const int64_t* k_strides, const void* v, const int64_t* v_strides, void* out,
                              const int64_t* out_strides, int64_t* argmax, const uint8_t* key_padding_mask,
                              const uint8_t* skip_heads, int64_t B, int64_t Hq, int64_t Hkv, int64_t M,
                              int64_t N, int64_t D, int causal, float sm_scale, int64_t argmax_rows,
                              int block_m, int block_n, int num_threads) {
    if (B < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || M < 0 || M > N || D <= 0 || argmax_rows < 0 ||
        argmax_rows > M || N >= (int64_t(1) << 31) || block_m <= 0 || block_n <= 0 || block_n % 32)
        return 1;
    if (argmax_rows > 0 && !argmax) return 1;
    Args a{q, k, v, q_strides, k_strides, v_strides, out_strides, out, argmax, key_padding_mask, skip_heads,
           B, Hq, Hkv, M, N, D, argmax_rows, causal != 0, sm_scale, block_m, block_n};
    if (B == 0 || M == 0) return 0;
#ifdef _OPENMP
    int saved = omp_get_max_threads();
    if (num_threads > 0) omp_set_num_threads(num_threads);
#else
    (void)num_threads;
#endif
    int rc = 1;
    switch (dtype) {
        case 0: rc = run<F32>(a); break;
        case 1: rc = run<F16>(a); break;
        case 2: rc = run<BF16>(a); break;
        default: rc = 1;
    }
#ifdef _OPENMP
    if (num_threads > 0) omp_set_num_threads(saved);
#endif
    return rc;
}

}  // extern "C"
