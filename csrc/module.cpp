// retmask._C: the pybind11 binding of the fused CPU attention kernel (attention_cpu.h) and of the CPU linear
// kernel for few input rows (linear_cpu.h).
//
// No torch headers: tensors arrive as (data pointer, dtype code, shape, strides) tuples of plain integers,
// so the module builds against any torch (or none) and never links libtorch. The binding checks what the
// kernel relies on and raises ValueError naming the bad argument (wrong dtype code, mismatched shapes,
// non-contiguous argmax / masks; the kernel adds its own checks on sizes and tile settings), MemoryError if
// the kernel's scratch cannot be allocated, TypeError (from pybind11) for arguments of the wrong type or
// number. The compute runs without the GIL. The optional features (window, softcap, sinks, bf16_dot,
// sink_tokens) are trailing keyword arguments with "off" defaults.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "attention_cpu.h"
#include "linear_cpu.h"

namespace py = pybind11;

namespace {

using retmask::DType;

// A tensor as Python passes it: (data_ptr(), dtype code, shape, stride()), strides in elements.
using TensorArg = std::tuple<std::uintptr_t, int, std::vector<int64_t>, std::vector<int64_t>>;

const char* dtype_name(int code) {
    switch (code) {
        case static_cast<int>(DType::Float32): return "float32";
        case static_cast<int>(DType::Float16): return "float16";
        case static_cast<int>(DType::BFloat16): return "bfloat16";
        case static_cast<int>(DType::Int64): return "int64";
        case static_cast<int>(DType::Bool): return "bool";
        default: return nullptr;
    }
}

std::string dtype_str(int code) {
    const char* n = dtype_name(code);
    return n ? n : "unknown dtype code " + std::to_string(code);
}

std::string num_str(double x) {  // %g: "-1", "1e-60", "nan", "inf"
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", x);
    return buf;
}

std::string dims_str(const std::vector<int64_t>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
}

[[noreturn]] void bad(const char* name, const std::string& what) {
    throw std::invalid_argument(std::string(name) + ": " + what);
}

struct Tensor {
    const char* name;
    std::uintptr_t ptr;
    int dtype;
    const std::vector<int64_t>& shape;
    const std::vector<int64_t>& strides;
};

// Unpacks a tensor argument and checks its rank and, for expect >= 0, its dtype code.
Tensor unpack(const char* name, const TensorArg& t, size_t ndim, int expect) {
    Tensor x{name, std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t)};
    if (x.shape.size() != ndim)
        bad(name, "expected " + std::to_string(ndim) + " dims, got shape " + dims_str(x.shape));
    if (x.strides.size() != ndim)
        bad(name, "expected " + std::to_string(ndim) + " strides, got " + dims_str(x.strides));
    if (expect >= 0 && x.dtype != expect)
        bad(name, "dtype " + dtype_str(x.dtype) + ", expected " + dtype_str(expect));
    return x;
}

void expect_shape(const Tensor& x, const std::vector<int64_t>& want, const char* what) {
    if (x.shape != want) bad(x.name, "shape " + dims_str(x.shape) + ", expected " + what + " = " + dims_str(want));
}

// Row-major contiguous (strides of size-1 dims do not matter, as in torch).
void expect_contiguous(const Tensor& x) {
    int64_t expected = 1;
    for (size_t i = x.shape.size(); i-- > 0;) {
        if (x.shape[i] != 1 && x.strides[i] != expected)
            bad(x.name, "must be contiguous, got strides " + dims_str(x.strides) + " for shape " + dims_str(x.shape));
        expected *= x.shape[i];
    }
}

std::array<int64_t, 4> strides4(const Tensor& x) {
    return {x.strides[0], x.strides[1], x.strides[2], x.strides[3]};
}

// The checks the forward and the backward share: q's dtype is a float type, k / v of q's dtype and
// shapes [B, Hkv, N, D] with B and D of q; returns (B, Hq, M, D, Hkv, N).
std::array<int64_t, 6> check_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
    if (q.dtype != static_cast<int>(DType::Float32) && q.dtype != static_cast<int>(DType::Float16) &&
        q.dtype != static_cast<int>(DType::BFloat16))
        bad("q", "dtype " + dtype_str(q.dtype) + ", expected float32, float16 or bfloat16");
    if (k.dtype != q.dtype) bad("k", "dtype " + dtype_str(k.dtype) + ", expected " + dtype_str(q.dtype));
    if (v.dtype != q.dtype) bad("v", "dtype " + dtype_str(v.dtype) + ", expected " + dtype_str(q.dtype));
    const int64_t B = q.shape[0], Hq = q.shape[1], M = q.shape[2], D = q.shape[3];
    const int64_t Hkv = k.shape[1], N = k.shape[2];
    expect_shape(k, {B, Hkv, N, D}, "[B, Hkv, N, D] with B and D of q");
    expect_shape(v, k.shape, "the shape of k");
    return {B, Hq, M, D, Hkv, N};
}

// A bool [rows, cols] contiguous mask argument (None: null).
const uint8_t* mask_arg(const char* name, const std::optional<TensorArg>& arg, int64_t rows, int64_t cols,
                        const char* what) {
    if (!arg) return nullptr;
    const Tensor m = unpack(name, *arg, 2, static_cast<int>(DType::Bool));
    expect_shape(m, {rows, cols}, what);
    expect_contiguous(m);
    return reinterpret_cast<const uint8_t*>(m.ptr);
}

// The fields the forward's and the backward's arguments share: masks, sizes (shape from check_qkv),
// causal and the scale.
template <class Args>
void set_shared(Args& a, const std::array<int64_t, 6>& shape, const std::optional<TensorArg>& kpm_arg,
                const std::optional<TensorArg>& skip_arg, bool causal, float sm_scale) {
    const auto [B, Hq, M, D, Hkv, N] = shape;
    a.key_padding_mask = mask_arg("key_padding_mask", kpm_arg, B, N, "[B, N]");
    a.skip_heads = mask_arg("skip_heads", skip_arg, B, Hq, "[B, Hq]");
    a.B = B;
    a.Hq = Hq;
    a.Hkv = Hkv;
    a.M = M;
    a.N = N;
    a.D = D;
    a.causal = causal;
    a.sm_scale = sm_scale;
}

int64_t attention_fwd(const TensorArg& q_arg, const TensorArg& k_arg, const TensorArg& v_arg, const TensorArg& out_arg,
                      const std::optional<TensorArg>& argmax_arg, const std::optional<TensorArg>& kpm_arg,
                      const std::optional<TensorArg>& skip_arg, bool causal, float sm_scale, int block_m, int block_n,
                      int num_threads, int64_t window, double softcap, const std::optional<TensorArg>& sinks_arg,
                      const std::string& isa, bool bf16_dot, int64_t sink_tokens) {
    const Tensor q = unpack("q", q_arg, 4, -1);
    const Tensor k = unpack("k", k_arg, 4, -1);
    const Tensor v = unpack("v", v_arg, 4, -1);
    const std::array<int64_t, 6> shape = check_qkv(q, k, v);
    const auto [B, Hq, M, D, Hkv, N] = shape;
    const Tensor out = unpack("out", out_arg, 4, q.dtype);
    expect_shape(out, q.shape, "the shape of q");

    retmask::AttentionFwdArgs a;
    a.dtype = static_cast<DType>(q.dtype);
    a.q = reinterpret_cast<const void*>(q.ptr);
    a.k = reinterpret_cast<const void*>(k.ptr);
    a.v = reinterpret_cast<const void*>(v.ptr);
    a.out = reinterpret_cast<void*>(out.ptr);
    a.q_strides = strides4(q);
    a.k_strides = strides4(k);
    a.v_strides = strides4(v);
    a.out_strides = strides4(out);
    if (argmax_arg) {
        const Tensor am = unpack("argmax", *argmax_arg, 3, static_cast<int>(DType::Int64));
        if (am.shape[0] != B || am.shape[1] != Hq)
            bad("argmax", "shape " + dims_str(am.shape) + ", expected [B, Hq, argmax_rows] = [" + std::to_string(B) +
                              ", " + std::to_string(Hq) + ", T]");
        expect_contiguous(am);
        a.argmax_rows = am.shape[2];  // the kernel checks 0 <= T <= M
        if (a.argmax_rows > 0) a.argmax = reinterpret_cast<int64_t*>(am.ptr);
    }
    set_shared(a, shape, kpm_arg, skip_arg, causal, sm_scale);
    a.block_m = block_m;
    a.block_n = block_n;
    a.num_threads = num_threads;
    a.window = window;  // the kernel checks window >= 0 and causal
    a.sink_tokens = sink_tokens;  // the kernel checks sink_tokens >= 0 and a window
    if (!(softcap >= 0.0) || !std::isfinite(softcap))
        bad("softcap", num_str(softcap) + " is not a finite value > 0 (or 0: no capping)");
    a.softcap = static_cast<float>(softcap);
    if (softcap > 0.0 && !(a.softcap > 0.f && std::isfinite(a.softcap)))
        bad("softcap", num_str(softcap) + " is not representable as a float32 > 0");
    if (sinks_arg) {
        const Tensor sinks = unpack("sinks", *sinks_arg, 1, static_cast<int>(DType::Float32));
        expect_shape(sinks, {Hq}, "[Hq]");
        expect_contiguous(sinks);
        if (Hq > 0 && !sinks.ptr) bad("sinks", "null data pointer");
        a.sinks = reinterpret_cast<const float*>(sinks.ptr);
    }

    a.isa = isa;  // the kernel checks the name against the builds this CPU runs
    a.bf16_dot = bf16_dot;  // the kernel checks bfloat16 and an even D
    int64_t visited = 0;
    a.visited_logits = &visited;
    py::gil_scoped_release no_gil;
    retmask::attention_fwd_cpu(a);  // std::invalid_argument -> ValueError, std::bad_alloc -> MemoryError
    return visited;
}

void attention_bwd(const TensorArg& dout_arg, const TensorArg& q_arg, const TensorArg& k_arg, const TensorArg& v_arg,
                   const TensorArg& dq_arg, const TensorArg& dk_arg, const TensorArg& dv_arg,
                   const std::optional<TensorArg>& kpm_arg, const std::optional<TensorArg>& skip_arg, bool causal,
                   float sm_scale, int64_t block_m, int num_threads, const std::string& isa, int64_t window,
                   int64_t sink_tokens) {
    const Tensor q = unpack("q", q_arg, 4, -1);
    const Tensor k = unpack("k", k_arg, 4, -1);
    const Tensor v = unpack("v", v_arg, 4, -1);
    const std::array<int64_t, 6> shape = check_qkv(q, k, v);
    const Tensor dout = unpack("dout", dout_arg, 4, q.dtype);
    const Tensor dq = unpack("dq", dq_arg, 4, q.dtype);
    const Tensor dk = unpack("dk", dk_arg, 4, q.dtype);
    const Tensor dv = unpack("dv", dv_arg, 4, q.dtype);
    expect_shape(dout, q.shape, "the shape of q");
    expect_shape(dq, q.shape, "the shape of q");
    expect_shape(dk, k.shape, "the shape of k");
    expect_shape(dv, k.shape, "the shape of k");

    retmask::AttentionBwdArgs a;
    a.dtype = static_cast<DType>(q.dtype);
    a.q = reinterpret_cast<const void*>(q.ptr);
    a.k = reinterpret_cast<const void*>(k.ptr);
    a.v = reinterpret_cast<const void*>(v.ptr);
    a.dout = reinterpret_cast<const void*>(dout.ptr);
    a.dq = reinterpret_cast<void*>(dq.ptr);
    a.dk = reinterpret_cast<void*>(dk.ptr);
    a.dv = reinterpret_cast<void*>(dv.ptr);
    a.q_strides = strides4(q);
    a.k_strides = strides4(k);
    a.v_strides = strides4(v);
    a.dout_strides = strides4(dout);
    a.dq_strides = strides4(dq);
    a.dk_strides = strides4(dk);
    a.dv_strides = strides4(dv);
    set_shared(a, shape, kpm_arg, skip_arg, causal, sm_scale);
    a.block_m = block_m;
    a.num_threads = num_threads;
    a.isa = isa;
    a.window = window;  // the kernel checks window >= 0 and causal
    a.sink_tokens = sink_tokens;  // the kernel checks sink_tokens >= 0 and a window
    py::gil_scoped_release no_gil;
    retmask::attention_bwd_cpu(a);  // std::invalid_argument -> ValueError, std::bad_alloc -> MemoryError
}

// A [rows, cols] matrix argument whose columns have unit stride (any row stride); returns the row stride.
int64_t unit_column_stride(const Tensor& t) {
    if (t.shape[1] > 1 && t.strides[1] != 1)
        bad(t.name, "needs unit stride along its last dim, got strides " + dims_str(t.strides));
    return t.strides[0];
}

void linear_rows(const TensorArg& x_arg, const TensorArg& w_arg, const std::optional<TensorArg>& bias_arg,
                 const TensorArg& y_arg, int num_threads, const std::string& isa) {
    const Tensor x = unpack("x", x_arg, 2, -1);
    if (x.dtype != static_cast<int>(DType::Float32) && x.dtype != static_cast<int>(DType::BFloat16))
        bad("x", "dtype " + dtype_str(x.dtype) + ", expected float32 or bfloat16");
    const Tensor w = unpack("weight", w_arg, 2, x.dtype);
    const int64_t rows = x.shape[0], K = x.shape[1], N = w.shape[0];
    expect_shape(w, {N, K}, "[N, K] with K of x");
    const Tensor y = unpack("y", y_arg, 2, x.dtype);
    expect_shape(y, {rows, N}, "[rows of x, N of weight]");
    if (rows > 0 && N > 0) expect_contiguous(y);  // an empty tensor's strides are arbitrary

    retmask::LinearArgs a;
    a.dtype = static_cast<DType>(x.dtype);
    a.x = reinterpret_cast<const void*>(x.ptr);
    a.weight = reinterpret_cast<const void*>(w.ptr);
    a.y = reinterpret_cast<void*>(y.ptr);
    a.rows = rows;
    a.N = N;
    a.K = K;
    a.x_stride = unit_column_stride(x);
    a.w_stride = unit_column_stride(w);
    if (bias_arg) {
        const Tensor b = unpack("bias", *bias_arg, 1, x.dtype);
        expect_shape(b, {N}, "[N]");
        expect_contiguous(b);
        a.bias = reinterpret_cast<const void*>(b.ptr);
    }
    a.num_threads = num_threads;
    a.isa = isa;
    py::gil_scoped_release no_gil;
    retmask::linear_rows_cpu(a);  // std::invalid_argument -> ValueError
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "retmask fused CPU attention kernel (C++/OpenMP, no torch headers)";
    py::dict codes;
    for (int c = 0; c <= static_cast<int>(DType::Bool); ++c) codes[dtype_name(c)] = c;
    m.attr("DTYPE_CODES") = codes;
    m.def("attention_fwd", &attention_fwd, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
          py::arg("argmax").none(true), py::arg("key_padding_mask").none(true), py::arg("skip_heads").none(true),
          py::arg("causal"), py::arg("sm_scale"), py::arg("block_m"), py::arg("block_n"), py::arg("num_threads"),
          py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks").none(true) = py::none(),
          py::arg("isa") = "", py::arg("bf16_dot") = false, py::arg("sink_tokens") = 0,
          R"doc(Fused attention forward with per-row argmax of the logits, head skipping, sliding window (with
sink tokens), logit soft-capping and attention sinks.

Tensors are (data_ptr, dtype code, shape, strides) tuples (codes: DTYPE_CODES; strides in elements):
q [B, Hq, M, D] and out (same shape) of float32 / float16 / bfloat16, any strides; k, v [B, Hkv, N, D]
of q's dtype, any strides; argmax int64 [B, Hq, T] contiguous or None: the argmax of the logits of the
last T query rows (-1 where a row has no valid key); key_padding_mask bool [B, N] contiguous (True = valid)
or None; skip_heads bool [B, Hq] contiguous (True = skipped: zeros and -1) or None. Writes every element
of out and argmax. block_m: tile rows per work item; block_n: keys per block (multiple of 32);
num_threads: OpenMP threads for calls large enough to split (<= 0: the OpenMP default).
Optional features (the contract of retmask/kernels/reference.py; row i sits at position p = N - M + i):
window: int >= 1, the row sees keys p - window < j <= p (needs causal; only the key blocks inside the
window are visited), 0 = none; sink_tokens: int >= 1 (needs window), the row also sees the keys
j < sink_tokens (j <= p): StreamingLLM's kept first keys, not the sink logits below (only their key
blocks are visited besides the window's), 0 = none; softcap: float > 0, logits s <- softcap * tanh(s / softcap) before the
softmax and the argmax, 0 = none; sinks: float32 [Hq] contiguous or None, one logit per query head in
the softmax denominator only (never an argmax).
isa: which build of the kernel runs, a name from BUILDS ("" = the widest this CPU has).
bf16_dot: bfloat16 calls with an even D run both products as bf16 dot products (pairs of dims for Q K^T,
pairs of keys for P V, P rounded to bf16 first) in the lanes layout, tiles of fewer rows padded to a
vector: vdpbf16ps in the avx512bf16 build, emulated bit for bit by the others.
Rows without an allowed key give 0 and -1; rows with a NaN or +inf logit among their allowed keys give
NaN and -1.
Returns the number of (query row, key) logits computed (key-block visits times their tiles' rows).
Raises ValueError naming a bad argument, MemoryError if scratch memory cannot be allocated.)doc");
    m.def("attention_bwd", &attention_bwd, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("dq"),
          py::arg("dk"), py::arg("dv"), py::arg("key_padding_mask").none(true), py::arg("skip_heads").none(true),
          py::arg("causal"), py::arg("sm_scale"), py::arg("block_m") = 0, py::arg("num_threads") = 0,
          py::arg("isa") = "", py::arg("window") = 0, py::arg("sink_tokens") = 0,
          R"doc(Backward of attention_fwd without soft-capping or sinks: writes
dq, dk, dv, the gradients of out = softmax(sm_scale * q k^T + mask) v for the output gradient dout.

Tensors as in attention_fwd: dout, q, dq [B, Hq, M, D]; k, v, dk, dv [B, Hkv, N, D]; one dtype (float32,
float16 or bfloat16), any strides; key_padding_mask bool [B, N] and skip_heads bool [B, Hq] contiguous or
None. Computed in fp32 (half-precision inputs converted exactly, each gradient rounded once); the logits
are recomputed, so the forward's output is not needed. Skipped heads get dq = 0 and add nothing to dk, dv;
rows without an allowed key get dq = 0. block_m: query rows per block (0: sized for the cache);
num_threads: OpenMP threads (<= 0: the OpenMP default; small calls run on one); isa: as in attention_fwd;
window: int >= 1, the sliding window of attention_fwd (needs causal; only the keys a block of rows sees
are visited), 0 = none; sink_tokens: the sink tokens of attention_fwd (needs window), 0 = none.
Raises ValueError naming a bad argument, MemoryError if scratch memory cannot be allocated.)doc");
    m.def("linear_rows", &linear_rows, py::arg("x"), py::arg("weight"), py::arg("bias").none(true), py::arg("y"),
          py::arg("num_threads") = 0, py::arg("isa") = "",
          R"doc(y = x @ weight^T (+ bias) for few input rows, reading the weight once, in place.

Tensors as in attention_fwd: x [rows, K] and weight [N, K] with unit stride along K (any row stride),
bias [N] contiguous or None, y [rows, N] contiguous; one dtype, float32 or bfloat16. Sums in fp32
(bfloat16: rounded to the nearest even once). Writes every element of y. num_threads: OpenMP threads for
calls large enough to split (<= 0: the OpenMP default); isa: as in attention_fwd.
Raises ValueError naming a bad argument.)doc");
    // The kernel's builds this CPU runs, widest first: ((name, fp32 lanes), ...); the first is the default.
    py::list builds;
    for (const auto& [name, lanes] : retmask::cpu_builds()) builds.append(py::make_tuple(name, lanes));
    m.attr("BUILDS") = py::tuple(builds);
}
