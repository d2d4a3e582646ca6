// The fused CPU attention kernel (attention_cpu.cpp and its per-ISA builds) as its Python binding (module.cpp) calls it.
// Plain C++17: no Python and no torch headers, so the kernel builds and links without either.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace retmask {

// Element types, by the codes the binding receives (module.cpp exports them as _C.DTYPE_CODES).
// q, k, v and out are one of the first three; argmax is Int64; masks are Bool (one byte, 0 or 1).
enum class DType : int { Float32 = 0, Float16 = 1, BFloat16 = 2, Int64 = 3, Bool = 4 };

struct AttentionFwdArgs {
    DType dtype = DType::Float32;  // of q, k, v and out
    const void* q = nullptr;       // [B, Hq, M, D]
    const void* k = nullptr;       // [B, Hkv, N, D]
    const void* v = nullptr;       // [B, Hkv, N, D]
    void* out = nullptr;           // [B, Hq, M, D]
    std::array<int64_t, 4> q_strides{}, k_strides{}, v_strides{}, out_strides{};  // in elements
    int64_t* argmax = nullptr;                   // [B, Hq, argmax_rows] contiguous; null iff argmax_rows == 0
    const uint8_t* key_padding_mask = nullptr;   // [B, N] contiguous, 1 = valid key; or null
    const uint8_t* skip_heads = nullptr;         // [B, Hq] contiguous, 1 = skipped head; or null
    int64_t B = 0, Hq = 0, Hkv = 0, M = 0, N = 0, D = 0;
    int64_t argmax_rows = 0;  // argmax of the logits for the last argmax_rows query rows
    bool causal = true;       // query row i sits at key position N - M + i
    float sm_scale = 1.f;
    // Sliding window: the row at position p sees only keys p - window < j <= p (and only the key blocks
    // meeting that range are visited). 0 = no window; > 0 needs causal; window >= N is no window.
    int64_t window = 0;
    // Sink tokens (StreamingLLM's attention sinks: kept KEYS, not the learned logits of `sinks` below): with
    // a window, the row at position p also sees keys j < sink_tokens (j <= p), i.e. keys j <= p with
    // p - window < j or j < sink_tokens; the key blocks holding them are visited besides the window's.
    // 0 = none; > 0 needs window > 0. sink_tokens + window >= N hides nothing: plain causal.
    int64_t sink_tokens = 0;
    // Logit soft-capping: scaled logits s <- softcap * tanh(s / softcap) before max, softmax and argmax.
    // 0 = none; else finite and > 0.
    float softcap = 0.f;
    // Attention sinks: [Hq] contiguous fp32, one logit per query head that joins the softmax denominator
    // only (out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}); never an argmax); or null.
    const float* sinks = nullptr;
    // bfloat16 calls with an even D: both products as bf16 dot products in the lanes layout, whatever the
    // tile size (vdpbf16ps in the avx512bf16 build, emulated bit for bit in the others), P rounded to bf16
    // before P V.
    bool bf16_dot = false;
    int block_m = 128;        // tile rows per work item (over the active heads of a kv group)
    int block_n = 64;         // keys per block, a multiple of 32
    int num_threads = 0;      // OpenMP threads for calls large enough to split; <= 0: the OpenMP default
    // Which build of the kernel runs: "" = the widest this CPU has, else a name from cpu_builds().
    std::string isa;
    // If not null, receives the number of (query row, key) logits the kernel computed: key-block visits
    // times the real rows of their tiles (tests check that a window visits O(M * (window + sink_tokens))).
    int64_t* visited_logits = nullptr;
};

// The builds of the kernel this CPU can run, widest first, as (name, fp32 vector lanes): ("avx512bf16", 16)
// with AVX-512F + AVX512-BF16 (the only build that runs bf16_dot natively), ("avx512", 16) with AVX-512F,
// ("avx2", 8) with AVX2 + FMA, and always ("generic", 8).
std::vector<std::pair<std::string, int>> cpu_builds();

// Checks the sizes, pointers, tile and feature settings (std::invalid_argument naming the bad field), then
// runs the kernel: writes every element of out (and of argmax). A row with no allowed key gives 0 and
// argmax -1; a row with a NaN or +inf logit (after capping) among its allowed keys gives NaN in every
// element and argmax -1; a skipped head gives 0 and -1 and reads nothing. Throws std::bad_alloc if its
// scratch memory cannot be allocated. Touches no Python state: the binding calls it without the GIL.
void attention_fwd_cpu(const AttentionFwdArgs& args);

// The backward of attention_fwd_cpu without soft-capping or sinks (causal or not, key padding, skipped
// heads, GQA, a sliding window with or without sink tokens): the gradients of out with respect to q, k and v given the gradient
// dout of out, computed in fp32 whatever the dtype (fp16 / bf16 converted exactly on load, each gradient
// rounded once when stored). The logits are recomputed; the forward's output is not needed.
struct AttentionBwdArgs {
    DType dtype = DType::Float32;  // of every tensor
    const void* q = nullptr;       // [B, Hq, M, D]
    const void* k = nullptr;       // [B, Hkv, N, D]
    const void* v = nullptr;       // [B, Hkv, N, D]
    const void* dout = nullptr;    // [B, Hq, M, D]
    void* dq = nullptr;            // [B, Hq, M, D]
    void* dk = nullptr;            // [B, Hkv, N, D]
    void* dv = nullptr;            // [B, Hkv, N, D]
    std::array<int64_t, 4> q_strides{}, k_strides{}, v_strides{}, dout_strides{};  // in elements
    std::array<int64_t, 4> dq_strides{}, dk_strides{}, dv_strides{};
    const uint8_t* key_padding_mask = nullptr;  // [B, N] contiguous, 1 = valid key; or null
    const uint8_t* skip_heads = nullptr;        // [B, Hq] contiguous, 1 = skipped head; or null
    int64_t B = 0, Hq = 0, Hkv = 0, M = 0, N = 0, D = 0;
    bool causal = true;  // query row i sits at key position N - M + i
    float sm_scale = 1.f;
    int64_t window = 0;   // as in AttentionFwdArgs: > 0 needs causal; >= N is no window
    int64_t sink_tokens = 0;  // as in AttentionFwdArgs: > 0 needs window > 0
    int64_t block_m = 0;  // query rows per block (whole rows: all their keys); 0 = sized for the cache
    int num_threads = 0;  // OpenMP threads; <= 0: the OpenMP default
    std::string isa;      // as in AttentionFwdArgs
};

// Checks the arguments (std::invalid_argument naming the bad field), then writes every element of dq, dk
// and dv. Skipped heads get dq = 0 and add nothing to dk, dv; a row with no allowed key gets dq = 0.
// Deterministic for a given thread count (fixed order of sums; another count may round differently).
// Throws std::bad_alloc if scratch cannot be allocated.
// Touches no Python state.
void attention_bwd_cpu(const AttentionBwdArgs& args);

}  // namespace retmask
