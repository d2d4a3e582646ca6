// The ISA-generic body of the CPU attention backward, compiled once per instruction set right after
// attention_cpu_kernel.h (whose vectors, exp, element types, tile helpers and scratch memory it uses).
//
// Gradients of out = softmax(scale * Q K^T + mask) V for one query block of m rows and the n keys they
// see, everything in fp32 (fp16 / bf16 inputs are converted on load, exactly; the gradients are rounded
// once, when stored):
//
//   S  = Q K^T                    [m, n]   (1)  recomputed: the forward keeps no logits
//   P  = softmax(scale * S)       [m, n]        row max, exp, sum over the row's allowed keys
//   dP = dO V^T                   [m, n]   (2)
//   Di = sum_j P_ij dP_ij                       (= dO_i . O_i, so the forward's output is not needed)
//   dS = scale * P (dP - Di)      [m, n]
//   dV += P^T dO                  [n, D]   (3)
//   dK += dS^T Q                  [n, D]   (4)
//   dQ  = dS K                    [m, D]   (5)
//
// A query block holds whole rows (all the keys a row sees), so the softmax needs no online rescaling and
// dQ is final when the block ends; m is chosen so that S and dP stay in the core's cache. All five
// products run on the forward's micro-kernel (fma_tile), C[r][c] (+)= sum_k A(r, k) B[k][c] with B
// row-major along c (vectors) and A read one broadcast scalar at a time through strides, so a transposed
// A (P^T, dS^T) costs nothing: (1) and (2) take B = K^T / V^T (transposed once per work item), (3)-(5) B = dO, Q, K.
// Causal attention skips what the triangle hides: (1)-(2) start each key tile at the first row that
// sees it, (3)-(4) start each key tile's sum at that row, (5) stops each row tile's sum at its last key.
// Sink tokens (keys < sink that every row at or past them sees besides its window) get columns of their
// own before the window's when they lie below the block's first window key, and each of the five products
// runs once more over them; otherwise the window's columns start at key 0 and include them. Either way a
// block's work stays O(rows x (window + rows + sink)).
//
// Work items are (batch, kv head, part): the active query heads of a kv group are split into `parts`
// interleaved subsets when there are too few groups to keep every thread busy. Each item sums its dK,
// dV into its own fp32 buffer; a second pass adds the parts of a group in a fixed order and stores the
// result: no atomics, so a call is deterministic for a given thread count whatever the schedule (the
// number of parts follows the thread count, so another count may round differently). Skipped heads get dq = 0
// and add nothing to dk, dv. A row with no allowed key gets dq = 0; a row whose allowed logits are all NaN
// (a NaN query) is a NaN row, as in the forward, not a row without a key.

namespace retmask::detail::RETMASK_ISA {
namespace {

#if RETMASK_VL == 16
constexpr int BW_NR = 6;  // 6 rows x 4 vectors = 24 accumulators + 4 B vectors + 1 broadcast (32 zmm)
constexpr int BW_CV = 4;
#else
constexpr int BW_NR = 6;  // 6 rows x 2 vectors = 12 accumulators + 2 B vectors + 1 broadcast (16 ymm)
constexpr int BW_CV = 2;
#endif

// C[r][c] (+)= sum_k A(r, k) B[k][c] for columns [0, cols) (a multiple of VL) and, in the column panel
// starting at c0, rows [r0, r1) = row_range(c0); k over k_range(r, nr) = [k0, k1) for the row tile
// [r, r + nr). Column panels outside, so a panel of B stays in cache across the row tiles.
template <bool ACC, class RowRange, class KRange>
RETMASK_INLINE void bw_gemm(int64_t cols, const float* A, int64_t ars, int64_t aks, const float* B, int64_t ldb,
                            float* C, int64_t ldc, RowRange&& row_range, KRange&& k_range) {
    tiles<BW_CV>(static_cast<int>(cols / VL), [&](auto cv, int c) RETMASK_LAMBDA_INLINE {
        const auto [r0, r1] = row_range(static_cast<int64_t>(c) * VL);
        tiles<BW_NR>(static_cast<int>(std::max<int64_t>(0, r1 - r0)), [&](auto nr, int r) RETMASK_LAMBDA_INLINE {
            const int64_t row = r0 + r;
            const auto [k0, k1] = k_range(row, static_cast<int64_t>(decltype(nr)::value));
            fma_tile<decltype(nr)::value, decltype(cv)::value, ACC>(A + row * ars, ars, aks, B + c * VL, ldb,
                                                                    C + row * ldc + c * VL, ldc, k0, k1);
        });
    });
}

// Rows [r0, r0 + n) of one (batch, head) of a typed [.., rows, D] input as fp32 rows of ld floats
// (columns D..ld zero).
template <class E>
void load_rows(const typename E::T* base, const int64_t* st, int64_t r0, int64_t n, int64_t D, float* dst,
               int64_t ld) {
    for (int64_t r = 0; r < n; ++r) {
        const typename E::T* src = base + (r0 + r) * st[2];
        float* row = dst + r * ld;
        for (int64_t d = 0; d < D; ++d) row[d] = E::load(src + d * st[3]);
        for (int64_t d = D; d < ld; ++d) row[d] = 0.f;
    }
}

// fp32 rows (ld floats apart) stored into a typed [.., rows, D] output at rows [r0, r0 + n).
template <class E>
void store_rows(const float* src, int64_t ld, typename E::T* base, const int64_t* st, int64_t r0, int64_t n,
                int64_t D) {
    for (int64_t r = 0; r < n; ++r) {
        typename E::T* row = base + (r0 + r) * st[2];
        for (int64_t d = 0; d < D; ++d) E::store(row + d * st[3], src[r * ld + d]);
    }
}

constexpr int64_t TRANSPOSE_ROWS = 16;  // keys per step of the transposes: one 64-byte line of K^T per dim

// One kv head's K and V as the products take them: Kf [NP][DP] (K rows, fp32), Kt, Vt [DP][NP] (K^T, V^T),
// zero beyond N keys and D dims. The transposes go TRANSPOSE_ROWS keys at a time, so each write fills
// whole cache lines (one key at a time, every write of a long K^T row missed the cache: at 8K keys and
// D = 256 the transposes took a third of a windowed backward). tile: TRANSPOSE_ROWS x DP floats.
template <class E>
void load_kv(const typename E::T* k, const int64_t* ks, const typename E::T* v, const int64_t* vs, int64_t N,
             int64_t D, int64_t NP, int64_t DP, float* Kf, float* Kt, float* Vt, float* tile) {
    load_rows<E>(k, ks, 0, N, D, Kf, DP);
    std::memset(Kf + N * DP, 0, (NP - N) * DP * sizeof(float));
    for (int64_t j0 = 0; j0 < NP; j0 += TRANSPOSE_ROWS) {
        const int64_t n = std::max<int64_t>(0, std::min<int64_t>(TRANSPOSE_ROWS, N - j0));  // real keys
        const int64_t w = std::min<int64_t>(TRANSPOSE_ROWS, NP - j0);  // columns up to NP
        load_rows<E>(v, vs, j0, n, D, tile, DP);
        for (int64_t d = 0; d < DP; ++d)
            for (int64_t j = 0; j < w; ++j) {
                const bool in = j < n && d < D;
                Kt[d * NP + j0 + j] = in ? Kf[(j0 + j) * DP + d] : 0.f;
                Vt[d * NP + j0 + j] = in ? tile[j * DP + d] : 0.f;
            }
    }
}

template <class E>
void zero_rows(typename E::T* base, const int64_t* st, int64_t n, int64_t D) {
    for (int64_t r = 0; r < n; ++r)
        for (int64_t d = 0; d < D; ++d) E::store(base + r * st[2] + d * st[3], 0.f);
}

// Row i of the block: P_i = softmax over its allowed keys j < lim with lo <= j (or, SINK, j < sink) of
// scale * S_i (S row of width floats; key_ok[key] != 0 for a valid key), written over S; Di = P_i . dP_i;
// dS_i = scale * P_i (dP_i - Di) written over dP. Column c holds key kbase + c - sc, except the sink
// columns c < sc (SINK only: sink tokens in columns of their own), which hold key c. The row reads the
// columns of its window, [sc + vbegin, sc + vend), and SINK those of the sink tokens, [0, send); every
// other column gets P = dS = 0 (columns of keys the row does not see may never have been computed); so
// does the whole row when no key is allowed.
template <bool SINK>
void softmax_grad_row(float* __restrict S, float* __restrict dP, const int32_t* __restrict key_ok, int64_t kbase,
                      int64_t sc, int64_t lo, int64_t lim, int64_t sink, int64_t width, float scale) {
    const vf ninf = vbroadcast(NEG_INF);
    vi lane;
    for (int l = 0; l < VL; ++l) lane[l] = l;
    const int64_t vbegin = sc + std::max<int64_t>(0, (lo - kbase) / VL * VL), vend = sc + round_up(lim - kbase, VL);
    // Sink columns [0, send): their own segment (sc), or, when the sink tokens share the window's columns
    // (sc = 0, kbase = 0), the vectors holding keys < sink the row has in its past.
    int64_t send = 0;
    if constexpr (SINK) send = sc ? sc : std::min<int64_t>(round_up(sink, VL), vend);
    const int64_t wbegin = std::max(send, vbegin);
    // f(c) for every vector of columns the row reads: [0, send), then [wbegin, vend).
    auto each = [&](auto&& f) RETMASK_LAMBDA_INLINE {
        if constexpr (SINK)
            for (int64_t c = 0; c < send; c += VL) f(c);
        for (int64_t c = wbegin; c < vend; c += VL) f(c);
    };
    // Masking is a select, never an add: a NaN logit of a key the row may not see cannot reach it.
    auto logits = [&](int64_t c) RETMASK_LAMBDA_INLINE {
        const int64_t k0 = SINK && c < sc ? c : kbase + c - sc;  // key of column c
        const vi key = lane + static_cast<int32_t>(k0);
        vi ok = (viload(key_ok + k0) != 0) & (key < static_cast<int32_t>(lim));
        if constexpr (SINK)
            ok = ok & ((key >= static_cast<int32_t>(lo)) | (key < static_cast<int32_t>(sink)));
        else
            ok = ok & (key >= static_cast<int32_t>(lo));
        return ok ? vload(S + c) * scale : ninf;
    };
    auto zero = [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; c += VL) {
            vstore(S + c, vf{});
            vstore(dP + c, vf{});
        }
    };
    vf mx = ninf;
    each([&](int64_t c) RETMASK_LAMBDA_INLINE {
        const vf x = logits(c);
        mx = x > mx ? x : mx;
    });
    float row_max = hmax(mx);
    if (row_max == NEG_INF) {  // no allowed key: the forward gives 0, so every gradient is 0 ...
        // ... unless a NaN logit hid from the max (comparisons drop NaN lanes; a NaN query makes every
        // logit of its row NaN): the forward made that row NaN, so its gradients are NaN too, as for a
        // NaN among finite logits (e^{x - NaN} = NaN below), never the zeros of a row without a key.
        bool nan = false;
        each([&](int64_t c) RETMASK_LAMBDA_INLINE {
            const vf x = logits(c);
            for (int l = 0; l < VL; ++l) nan |= x[l] != x[l];
        });
        if (!nan) {
            zero(0, width);
            return;
        }
        row_max = std::numeric_limits<float>::quiet_NaN();
    }
    zero(send, wbegin);
    vf sum = vf{};
    each([&](int64_t c) RETMASK_LAMBDA_INLINE {
        const vf p = vexp(logits(c) - row_max);
        vstore(S + c, p);
        sum += p;
    });
    const float inv = 1.f / hsum(sum);
    vf dsum = vf{};
    each([&](int64_t c) RETMASK_LAMBDA_INLINE {
        const vf p = vload(S + c) * inv;
        vstore(S + c, p);
        dsum += p * vload(dP + c);
    });
    const float di = hsum(dsum);
    each([&](int64_t c) RETMASK_LAMBDA_INLINE {
        const vf p = vload(S + c);
        vstore(dP + c, p * (vload(dP + c) - di) * scale);
    });
    zero(vend, width);
}

struct BwdShape {
    int64_t DP;      // head dim rounded up to VL: the row length of every [.., D] scratch array
    int64_t NP;      // keys rounded up to VL
    int64_t SW;      // columns of the S and dP blocks: NP, or what a block of m rows sees through the window
                     // (and the sink tokens, rounded up to a vector)
    int64_t m;       // query rows per block
    int64_t parts;   // items per (batch, kv head)
    int64_t group;   // query heads per kv head
};

BwdShape bwd_shape(const BwdKernelArgs& a, int threads) {
    BwdShape s{};
    s.DP = round_up(a.D, VL);
    s.NP = round_up(a.N, VL);
    // S and dP of a block: 2 * m * SW floats; about 512 KB (half of a 1 MB L2) unless the
    // caller asked for a block size. Through a window, m rows see at most m + window - 1 keys.
    const int64_t seen = a.window ? std::min<int64_t>(s.NP, a.window + 128 + a.sink) : s.NP;
    s.m = a.block_m > 0 ? a.block_m : std::max<int64_t>(16, std::min<int64_t>(256, (int64_t(1) << 16) / seen));
    s.m = std::min<int64_t>(s.m, std::max<int64_t>(a.M, 1));
    // + 2 VL: the block's first key rounded down and its last rounded up to a vector
    // + the sink tokens' columns (a segment of their own, or the keys below the window's that they add)
    s.SW = a.window ? std::min<int64_t>(s.NP, round_up(s.m + a.window, VL) + 2 * VL + round_up(a.sink, VL)) : s.NP;
    s.group = a.Hq / a.Hkv;
    const int64_t groups = a.B * a.Hkv;
    s.parts = 1;
    if (threads > 1 && groups < 2 * threads)  // too few items: split each group's heads
        s.parts = std::min<int64_t>(s.group, (2 * threads + groups - 1) / groups);
    return s;
}

template <class E>
void run_bwd(const BwdKernelArgs& a, int threads) {
    using T = typename E::T;
    const BwdShape sh = bwd_shape(a, threads);
    const int64_t DP = sh.DP, NP = sh.NP, D = a.D, N = a.N, M = a.M;
    const int64_t off = N - a.M;  // query row i sits at key position off + i
    const int64_t n_items = a.B * a.Hkv * sh.parts;
    threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n_items)));

    // dK, dV partial sums of every item: [item][NP][DP] each; zero-filled by their items.
    const size_t part_floats = static_cast<size_t>(NP * DP);
    const Scratch partial_block(2 * part_floats * n_items * sizeof(float), 1);
    float* partials = reinterpret_cast<float*>(partial_block.slice(0));

    auto carve = [&](Carve& c) {
        struct Bufs {
            float *Kf, *Kt, *Vt, *Qb, *dOb, *dQb, *S, *dP, *tile;
            int32_t* key_ok;
        } b;
        b.Kf = c.take<float>(NP * DP);  // K rows, fp32 [NP][DP]
        b.Kt = c.take<float>(DP * NP);  // K^T [D][NP]
        b.Vt = c.take<float>(DP * NP);  // V^T [D][NP]
        b.Qb = c.take<float>(sh.m * DP);
        b.dOb = c.take<float>(sh.m * DP);
        b.dQb = c.take<float>(sh.m * DP);
        b.S = c.take<float>(sh.m * sh.SW);
        b.dP = c.take<float>(sh.m * sh.SW);
        b.key_ok = c.take<int32_t>(NP);
        b.tile = c.take<float>(TRANSPOSE_ROWS * DP);
        return b;
    };
    Carve sizing;
    carve(sizing);
    const Scratch scratch(sizing.bytes(), threads);

    const T* q = static_cast<const T*>(a.q);
    const T* k = static_cast<const T*>(a.k);
    const T* v = static_cast<const T*>(a.v);
    const T* dout = static_cast<const T*>(a.dout);
    T* dq = static_cast<T*>(a.dq);
    T* dk = static_cast<T*>(a.dk);
    T* dv = static_cast<T*>(a.dv);

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        Carve c(scratch.zeroed_slice(thread_num()));
        const auto buf = carve(c);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; ++it) {
            const int64_t part = it % sh.parts, g = (it / sh.parts) % a.Hkv, b = it / (sh.parts * a.Hkv);
            float* dKacc = partials + 2 * part_floats * it;
            float* dVacc = dKacc + part_floats;
            std::memset(dKacc, 0, 2 * part_floats * sizeof(float));
            bool loaded = false;  // K, V of this group converted (only once a head needs them)
            for (int64_t h = g * sh.group + part; h < (g + 1) * sh.group; h += sh.parts) {
                const T* qh = q + b * a.qs[0] + h * a.qs[1];
                const T* doh = dout + b * a.dos[0] + h * a.dos[1];
                T* dqh = dq + b * a.dqs[0] + h * a.dqs[1];
                if (a.skip && a.skip[b * a.Hq + h]) {
                    zero_rows<E>(dqh, a.dqs, M, D);
                    continue;
                }
                if (!loaded) {
                    load_kv<E>(k + b * a.ks[0] + g * a.ks[1], a.ks, v + b * a.vs[0] + g * a.vs[1], a.vs, N, D, NP,
                               DP, buf.Kf, buf.Kt, buf.Vt, buf.tile);
                    for (int64_t j = 0; j < NP; ++j) buf.key_ok[j] = j < N && (!a.kpm || a.kpm[b * N + j]);
                    loaded = true;
                }
                for (int64_t i0 = 0; i0 < M; i0 += sh.m) {
                    const int64_t mb = std::min<int64_t>(sh.m, M - i0);
                    // Row i (position p = off + i0 + i) sees the keys [lo(i), lim(i)); the block sees [klo, nb).
                    auto lim = [&](int64_t i) { return a.causal ? std::min<int64_t>(N, off + i0 + i + 1) : N; };
                    auto lo = [&](int64_t i) { return a.window ? std::max<int64_t>(0, off + i0 + i - a.window + 1) : 0; };
                    const int64_t nb = lim(mb - 1), klo = lo(0);
                    if (nb <= klo) {  // no row of the block sees a key
                        zero_rows<E>(dqh + i0 * a.dqs[2], a.dqs, mb, D);
                        continue;
                    }
                    // S and dP column sc + c holds key kbase + c (kbase aligned to a vector), up to key npad.
                    // Sink tokens (keys < sink, seen by every row at or past them): below the window's first
                    // vector they get the sc columns [0, sc) of their own (column c: key c), which every row
                    // of the block reads (they all lie in its past: sink <= kbase <= klo < lim(0)); else they
                    // join the window's columns, which then start at key 0 (kbase = 0, sc = 0).
                    const int64_t sink = a.sink, npad = round_up(nb, VL), SW = sh.SW;
                    int64_t kbase = klo / VL * VL, sc = 0, kfirst = klo;  // kfirst: first key a row sees
                    if (sink) {
                        if (round_up(sink, VL) <= kbase)
                            sc = round_up(sink, VL);
                        else
                            kbase = kfirst = 0;
                    }
                    load_rows<E>(qh, a.qs, i0, mb, D, buf.Qb, DP);
                    load_rows<E>(doh, a.dos, i0, mb, D, buf.dOb, DP);
                    // The rows that see key j: [first_row(j), last_row(j)] (clamped to the block).
                    auto first_row = [&](int64_t j) -> int64_t {
                        return a.causal ? std::min<int64_t>(mb, std::max<int64_t>(0, j - off - i0)) : 0;
                    };
                    auto rows_end = [&](int64_t j) -> int64_t {  // last_row(j) + 1
                        return a.window ? std::max<int64_t>(0, std::min<int64_t>(mb, j + a.window - off - i0)) : mb;
                    };
                    // ... of the keys [j, j_last]: up to the last row when a sink token is among them
                    auto rows_range = [&](int64_t j, int64_t j_last) {
                        return std::pair<int64_t, int64_t>(first_row(j), j < sink ? mb : rows_end(j_last));
                    };
                    auto all_rows = [&](int64_t) { return std::pair<int64_t, int64_t>(0, mb); };
                    auto all_d = [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, D); };
                    // (1) S = Q K^T and (2) dP = dO V^T: in the panel of keys [j, j + w), the rows that see one
                    const int64_t panel = BW_CV * VL;
                    auto panel_rows = [&](int64_t c) {
                        const int64_t j = kbase + c;
                        return rows_range(j, std::min<int64_t>(j + panel, npad) - 1);
                    };
                    float *const Sw = buf.S + sc, *const dPw = buf.dP + sc;  // the window's columns
                    bw_gemm<false>(npad - kbase, buf.Qb, DP, 1, buf.Kt + kbase, NP, Sw, SW, panel_rows, all_d);
                    bw_gemm<false>(npad - kbase, buf.dOb, DP, 1, buf.Vt + kbase, NP, dPw, SW, panel_rows, all_d);
                    if (sc) {
                        bw_gemm<false>(sc, buf.Qb, DP, 1, buf.Kt, NP, buf.S, SW, all_rows, all_d);
                        bw_gemm<false>(sc, buf.dOb, DP, 1, buf.Vt, NP, buf.dP, SW, all_rows, all_d);
                    }
                    if (sink) {
                        for (int64_t i = 0; i < mb; ++i)
                            softmax_grad_row<true>(buf.S + i * SW, buf.dP + i * SW, buf.key_ok, kbase, sc, lo(i),
                                                   lim(i), sink, sc + npad - kbase, a.scale);
                    } else {
                        for (int64_t i = 0; i < mb; ++i)
                            softmax_grad_row<false>(buf.S + i * SW, buf.dP + i * SW, buf.key_ok, kbase, 0, lo(i),
                                                    lim(i), 0, npad - kbase, a.scale);
                    }
                    // (3) dV += P^T dO and (4) dK += dS^T Q over the keys [kfirst, nb) (C rows relative to
                    // kbase): key tile [j, j + n) sums the rows that see one of its keys
                    auto key_rows = [&](int64_t) {
                        return std::pair<int64_t, int64_t>(kfirst - kbase, nb - kbase);
                    };
                    auto seeing_rows = [&](int64_t r, int64_t n) { return rows_range(kbase + r, kbase + r + n - 1); };
                    float* dVb = dVacc + kbase * DP;
                    float* dKb = dKacc + kbase * DP;
                    bw_gemm<true>(DP, Sw, 1, SW, buf.dOb, DP, dVb, DP, key_rows, seeing_rows);
                    bw_gemm<true>(DP, dPw, 1, SW, buf.Qb, DP, dKb, DP, key_rows, seeing_rows);
                    if (sc) {  // the sink tokens' own columns: every row of the block sees them
                        auto sink_rows = [&](int64_t) { return std::pair<int64_t, int64_t>(0, sink); };
                        auto block_rows = [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, mb); };
                        bw_gemm<true>(DP, buf.S, 1, SW, buf.dOb, DP, dVacc, DP, sink_rows, block_rows);
                        bw_gemm<true>(DP, buf.dP, 1, SW, buf.Qb, DP, dKacc, DP, sink_rows, block_rows);
                    }
                    // (5) dQ = dS K: row tile [i, i + n) sums the keys from its first row's lo (from key 0 when
                    // the sink tokens share the window's columns) to its last row's lim, then the sinks' own
                    const bool shared = sink && !sc;
                    auto seen_keys = [&](int64_t i, int64_t n) {
                        return std::pair<int64_t, int64_t>((shared ? 0 : lo(i)) - kbase, lim(i + n - 1) - kbase);
                    };
                    auto sink_keys = [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, sink); };
                    bw_gemm<false>(DP, dPw, SW, 1, buf.Kf + kbase * DP, DP, buf.dQb, DP, all_rows, seen_keys);
                    if (sc) bw_gemm<true>(DP, buf.dP, SW, 1, buf.Kf, DP, buf.dQb, DP, all_rows, sink_keys);
                    store_rows<E>(buf.dQb, DP, dqh, a.dqs, i0, mb, D);
                }
            }
        }
        // The parts of each group, added in order of part, stored as dk, dv.
#pragma omp for schedule(dynamic, 1)
        for (int64_t bg = 0; bg < a.B * a.Hkv; ++bg) {
            float* first = partials + 2 * part_floats * (bg * sh.parts);
            for (int64_t p = 1; p < sh.parts; ++p) {
                const float* more = first + 2 * part_floats * p;
                for (size_t x = 0; x < 2 * part_floats; x += VL) vstore(first + x, vload(first + x) + vload(more + x));
            }
            const int64_t b = bg / a.Hkv, g = bg % a.Hkv;
            store_rows<E>(first, DP, dk + b * a.dks[0] + g * a.dks[1], a.dks, 0, N, D);
            store_rows<E>(first + part_floats, DP, dv + b * a.dvs[0] + g * a.dvs[1], a.dvs, 0, N, D);
        }
    }
}

}  // namespace

void run_bwd(const BwdKernelArgs& a, DType dtype, int threads) {
    by_dtype(dtype, [&](auto e) { run_bwd<decltype(e)>(a, threads); });
}

}  // namespace retmask::detail::RETMASK_ISA
