// Entry points of the fused CPU attention kernel (attention_cpu.h) and of the few-row linear kernel
// (linear_cpu.h): check the arguments, then run the build of the kernel (attention_cpu_kernel.h,
// linear_cpu_kernel.h) for the widest instruction set this CPU has.
//
// The kernel (and the linear kernel of linear_cpu.h, whose build is chosen the same way) is compiled four
// times into the one extension: AVX-512 + AVX512-BF16 (the AVX-512 build with native bf16 dot products),
// AVX-512 (16 fp32 lanes), AVX2 + FMA (8 lanes) and generic (8-lane vectors for whatever the compiler flags
// allow; the only build off x86). The choice
// is made here, at run time, from the CPU's feature bits, so one build of retmask._C runs on every x86 CPU
// and uses its vector width: no -march=native, and no illegal instruction when a build moves to another
// machine. A caller may ask for a narrower build by name (AttentionFwdArgs::isa), e.g. to compare them.
//
// Bad arguments are reported as std::invalid_argument naming the field, before any compute.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_cpu.h"
#include "attention_cpu_internal.h"
#include "linear_cpu.h"

namespace {

using retmask::detail::KernelArgs;

[[noreturn]] void bad(const char* field, const std::string& what) {
    throw std::invalid_argument(std::string(field) + ": " + what);
}

std::string str(int64_t x) { return std::to_string(x); }
std::string fstr(float x) {  // %g: "-1", "nan", "inf"
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(x));
    return buf;
}

// The dtype and sizes, as the forward and the backward both take them.
template <class Args>
void check_sizes(const Args& p) {
    using retmask::DType;
    if (p.dtype != DType::Float32 && p.dtype != DType::Float16 && p.dtype != DType::BFloat16)
        bad("dtype", "code " + str(static_cast<int>(p.dtype)) + " is not float32 (0), float16 (1) or bfloat16 (2)");
    if (p.B < 0) bad("B", "batch size " + str(p.B) + " < 0");
    if (p.Hq <= 0) bad("Hq", str(p.Hq) + " query heads, need at least 1");
    if (p.Hkv <= 0 || p.Hq % p.Hkv)
        bad("Hkv", str(p.Hkv) + " key/value heads do not divide Hq = " + str(p.Hq) + " query heads");
    if (p.N < 0 || p.N >= (int64_t(1) << 31)) bad("N", str(p.N) + " keys, need 0 <= N < 2^31");
    if (p.M < 0 || p.M > p.N)
        bad("M", str(p.M) + " query rows for N = " + str(p.N) + " keys (need 0 <= M <= N: the queries are the last M positions)");
    if (p.D <= 0) bad("D", "head dim " + str(p.D) + ", need at least 1");
}

// Sink tokens extend a sliding window (keys j < sink_tokens stay visible): they need one.
template <class Args>
void check_sink_tokens(const Args& p) {
    if (p.sink_tokens < 0) bad("sink_tokens", str(p.sink_tokens) + " keys, need >= 1 (or 0: none)");
    if (p.sink_tokens > 0 && p.window <= 0)
        bad("sink_tokens", str(p.sink_tokens) + " sink tokens need a sliding window (window >= 1): without one "
                           "every past key is visible already");
}

// (window, sink) as the kernels take them. A window of N or more keys hides nothing, nor does one whose sink
// tokens reach every row's window start: with sink + window >= N, row p <= N - 1 has p - window < sink, so
// its window (keys > p - window) and its sinks (keys < sink) cover all of [0, p]. Both are plain causal
// attention: (0, 0).
template <class Args>
std::pair<int64_t, int64_t> effective_pattern(const Args& p) {
    if (p.window <= 0 || p.window >= p.N) return {0, 0};
    if (p.sink_tokens > 0 && p.sink_tokens + p.window >= p.N) return {0, 0};
    return {p.window, p.sink_tokens};
}

void check(const retmask::AttentionFwdArgs& p) {
    using retmask::DType;
    check_sizes(p);
    if (p.argmax_rows < 0 || p.argmax_rows > p.M)
        bad("argmax_rows", str(p.argmax_rows) + " is not in [0, M = " + str(p.M) + "]");
    if (p.block_m <= 0) bad("block_m", str(p.block_m) + " rows per work item, need at least 1");
    if (p.block_n <= 0 || p.block_n % 32) bad("block_n", str(p.block_n) + " keys per block, need a positive multiple of 32");
    if (p.window < 0) bad("window", str(p.window) + " keys, need >= 1 (or 0: no window)");
    if (p.window > 0 && !p.causal)
        bad("window", "a sliding window (" + str(p.window) + " keys) needs causal attention");
    check_sink_tokens(p);
    if (!(p.softcap >= 0.f) || !std::isfinite(p.softcap))
        bad("softcap", fstr(p.softcap) + " is not a finite value > 0 (or 0: no capping)");
    if (p.bf16_dot) {
        if (p.dtype != DType::BFloat16)
            bad("bf16_dot", "bf16 dot products are for bfloat16 inputs, got dtype code " + str(static_cast<int>(p.dtype)));
        if (p.D % 2) bad("bf16_dot", "bf16 dot products take pairs of dims: D must be even, got " + str(p.D));
    }
    if (p.B > 0 && p.M > 0) {  // pointers the kernel reads or writes
        if (!p.q) bad("q", "null data pointer");
        if (!p.k) bad("k", "null data pointer");
        if (!p.v) bad("v", "null data pointer");
        if (!p.out) bad("out", "null data pointer");
        if (p.argmax_rows > 0 && !p.argmax) bad("argmax", "null data pointer with argmax_rows = " + str(p.argmax_rows));
    }
}


void check(const retmask::AttentionBwdArgs& p) {
    check_sizes(p);
    if (p.block_m < 0) bad("block_m", str(p.block_m) + " rows per block, need >= 1 (or 0: sized for the cache)");
    if (p.window < 0) bad("window", str(p.window) + " keys, need >= 1 (or 0: no window)");
    if (p.window > 0 && !p.causal)
        bad("window", "a sliding window (" + str(p.window) + " keys) needs causal attention");
    check_sink_tokens(p);
    if (!std::isfinite(p.sm_scale)) bad("sm_scale", fstr(p.sm_scale) + " is not finite");
    if (p.B > 0 && p.N > 0) {  // pointers the kernel reads or writes (q, dout, dq only with query rows)
        if (p.M > 0 && !p.q) bad("q", "null data pointer");
        if (p.M > 0 && !p.dout) bad("dout", "null data pointer");
        if (p.M > 0 && !p.dq) bad("dq", "null data pointer");
        if (!p.k) bad("k", "null data pointer");
        if (!p.v) bad("v", "null data pointer");
        if (!p.dk) bad("dk", "null data pointer");
        if (!p.dv) bad("dv", "null data pointer");
    }
}

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

using RunFn = void (*)(const KernelArgs&, retmask::DType, int);
using RunBwdFn = void (*)(const retmask::detail::BwdKernelArgs&, retmask::DType, int);

struct Build {
    const char* name;
    int lanes;
    RunFn run;
    RunBwdFn run_bwd;
    retmask::detail::LinearRowsFn linear_rows;  // the few-row linear kernel of this build
};

// The builds this CPU can run, widest first.
const std::vector<Build>& builds() {
    static const std::vector<Build> list = [] {
        std::vector<Build> v;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"))
            v.push_back({"avx512bf16", 16, retmask::detail::avx512bf16::run, retmask::detail::avx512bf16::run_bwd,
                         retmask::detail::avx512bf16::linear_rows});
        if (__builtin_cpu_supports("avx512f")) v.push_back({"avx512", 16, retmask::detail::avx512::run, retmask::detail::avx512::run_bwd,
                         retmask::detail::avx512::linear_rows});
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
            v.push_back({"avx2", 8, retmask::detail::avx2::run, retmask::detail::avx2::run_bwd,
                         retmask::detail::avx2::linear_rows});
#endif
        v.push_back({"generic", 8, retmask::detail::generic::run, retmask::detail::generic::run_bwd,
                         retmask::detail::generic::linear_rows});
        return v;
    }();
    return list;
}

const Build& pick(const std::string& isa) {
    const std::vector<Build>& list = builds();
    if (isa.empty()) return list.front();
    std::string names;
    for (const Build& b : list) {
        if (isa == b.name) return b;
        names += (names.empty() ? "" : ", ") + std::string(b.name);
    }
    bad("isa", "'" + isa + "' is not a build this CPU can run (" + names + "; empty: the widest)");
}

// The threads a call asks for (<= 0: the OpenMP default; 1 without OpenMP).
int resolve_threads(int requested) {
#ifdef _OPENMP
    return requested > 0 ? requested : omp_get_max_threads();
#else
    (void)requested;
    return 1;
#endif
}

}  // namespace

namespace retmask {

std::vector<std::pair<std::string, int>> cpu_builds() {
    std::vector<std::pair<std::string, int>> out;
    for (const Build& b : builds()) out.emplace_back(b.name, b.lanes);
    return out;
}

void attention_fwd_cpu(const AttentionFwdArgs& p) {
    check(p);
    const Build& build = pick(p.isa);  // an unknown name is an error even for empty inputs
    if (p.visited_logits) *p.visited_logits = 0;
    if (p.B == 0 || p.M == 0) return;
    // s / c as (s * cap_inv) * cap_post: one multiply (cap_post = 1, exact) unless 1 / c overflows.
    float cap_inv = p.softcap > 0.f ? 1.f / p.softcap : 0.f, cap_post = 1.f;
    if (!std::isfinite(cap_inv)) {
        cap_inv = 1.f / (p.softcap * 0x1p64f);
        cap_post = 0x1p64f;
    }
    const auto [window, sink] = effective_pattern(p);
    const KernelArgs a{p.q,   p.k,  p.v,  p.q_strides.data(), p.k_strides.data(), p.v_strides.data(), p.out_strides.data(),
                 p.out, p.argmax, p.key_padding_mask, p.skip_heads, p.B, p.Hq, p.Hkv, p.M, p.N, p.D, p.argmax_rows,
                 p.causal, p.sm_scale, p.block_m, p.block_n, window, sink,
                 p.softcap, cap_inv, cap_post, p.sinks, p.bf16_dot, p.visited_logits};
    int threads = resolve_threads(p.num_threads);
    build.run(a, p.dtype, threads);
}

// Calls with less work than this run on the calling thread (an OpenMP region costs more than they do).
constexpr int64_t BWD_SERIAL_FLOPS = int64_t(1) << 22;

void attention_bwd_cpu(const AttentionBwdArgs& p) {
    check(p);
    const Build& build = pick(p.isa);
    if (p.B == 0 || p.N == 0) return;
    const auto [window, sink] = effective_pattern(p);
    const detail::BwdKernelArgs a{p.q, p.k, p.v, p.dout, p.dq, p.dk, p.dv,
                                  p.q_strides.data(), p.k_strides.data(), p.v_strides.data(), p.dout_strides.data(),
                                  p.dq_strides.data(), p.dk_strides.data(), p.dv_strides.data(),
                                  p.key_padding_mask, p.skip_heads, p.B, p.Hq, p.Hkv, p.M, p.N, p.D,
                                  p.causal, p.sm_scale, p.block_m, window, sink};
    int threads = resolve_threads(p.num_threads);
    // five products of 2 * M * N * D flops per query head (half of them when causal)
    if (10 * p.B * p.Hq * p.M * p.N * p.D < BWD_SERIAL_FLOPS) threads = 1;
    build.run_bwd(a, p.dtype, threads);
}

void linear_rows_cpu(const LinearArgs& p) {
    check(p);
    const Build& build = pick(p.isa);  // an unknown name is an error even for empty inputs
    if (p.rows == 0 || p.N == 0) return;
    build.linear_rows({p.x, p.weight, p.bias, p.y, p.rows, p.N, p.K, p.x_stride, p.w_stride}, p.dtype,
                      resolve_threads(p.num_threads));
}

}  // namespace retmask
