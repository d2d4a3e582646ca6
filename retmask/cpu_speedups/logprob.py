"""Per-token log-probabilities of an LM head on a CPU, without the ``[tokens, vocab]`` logits.

For hidden states ``h: [N, H]``, an LM head ``W: [V, H]`` (bias ``b: [V]`` or None) and one target
token per row ``t: [N]``:

    z = transform(h W^T + b)          transform(y) = softcap * tanh(y * scale / softcap) / T
    log p(t) = z_t - logsumexp(z)     (without softcap: y * scale / T)

which is what TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``, used by its DPO trainer)
computes. :class:`CPUChunkedLogProb` has the same contract (arguments, the five outputs, gradients), so
it can stand in for it on CPU tensors; ``retmask.methods.retmask.fused_head.cpu_lm_head`` does that
during ``retmask train``.

Why another implementation. TRL's kernel is Triton; without Triton it folds each ``[N, chunk]`` tile
of logits with a dozen torch ops (upcasts, multiplications by a scale of 1.0, masks, ``zeros_like``),
and its backward upcasts the bf16 tile and the weight chunk to fp32 for the two gradient products,
which then run on fp32 BLAS. On 2 cores with AVX-512 its forward + backward took about 0.3 s in bf16 for
212 rows of SmolLM2 (49K vocabulary), where the three products need about 0.05 s on oneDNN's bf16 GEMM.
Here:

* the tile is folded in few passes (one max with its index, one exp, the sums), the scale / softcap /
  temperature only where they change something;
* the weight is cast to the compute dtype once per call and reused by the backward (TRL casts it per
  token chunk and again in the backward); a call that is one tile keeps its logits for the backward
  instead of computing them again;
* in bf16 (or fp16) all three products take operands in the compute dtype, are accumulated in fp32 and
  rounded to the compute dtype once, as autocast's own linear backward does. Where the CPU has native
  bf16 / fp16 GEMMs (AMX, AVX512-BF16) they run there, on oneDNN; elsewhere torch's half-precision
  matmuls are emulated and tens of times slower than fp32, so the same products run in fp32 on the
  rounded operands and are rounded after (``half_matmul.HalfProducts``: the same numbers up to the order
  of the fp32 sums); products of several vocabulary or token chunks are summed in
  fp32. The vocabulary is taken in chunks of up to ``TILE_BYTES`` of fp32 per tile, so that for a DPO
  batch of a few hundred completion tokens the whole vocabulary is one chunk and every gradient element
  is rounded once. TRL instead sums every chunk's product in fp32 through an fp32 GEMM (no bf16 rounding
  of the product, about 4x slower on that CPU);
* ``is_top1`` (the target is the first maximal logit) is the first index of the row's maximum.

Shapes and dtypes: hidden ``[N, H]`` (any float dtype; cast to the compute dtype), weight ``[V, H]``,
bias ``[V]`` or None, targets int64 ``[N]`` in ``[0, V)``. The compute dtype is the CPU autocast dtype
inside autocast, else the hidden states' dtype. Outputs are fp32 ``[N]``: log-probabilities, entropy,
``log sum p^2``, mean logit, and bool ``is_top1``; each but the first is None unless named in ``outputs``.
"""

from __future__ import annotations

import math

import torch

from .half_matmul import HalfProducts

TOKEN_CHUNK = 4096  # rows per token chunk (TRL's TOKEN_CHUNK_SIZE)
# fp32 bytes of one [rows, vocab chunk] tile; a vocab chunk is at least the caller's chunk_size
TILE_BYTES = 128 << 20
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def vocab_chunk(rows: int, vocab: int, chunk_size: int) -> int:
    """Vocabulary columns per tile: as many as ``TILE_BYTES`` of fp32 hold for ``rows`` rows, at least
    ``chunk_size`` (the caller's tile width), at most ``vocab``."""
    return max(1, min(vocab, max(chunk_size, TILE_BYTES // (4 * max(rows, 1)))))


def compute_dtype_for(hidden: torch.Tensor) -> torch.dtype:
    """The dtype of the products: CPU autocast's inside autocast, else the hidden states' own."""
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return hidden.dtype


class Transform:
    """z = transform(y): ``y * scale``, then ``softcap * tanh(. / softcap)`` if a softcap is set, then
    ``/ temperature``, in place on an fp32 tile; and the chain rule back through it."""

    def __init__(self, logit_scale: float, softcap: float | None, temperature: float) -> None:
        self.scale = float(logit_scale)
        self.softcap = float(softcap) if softcap else None
        self.inv_t = 1.0 / float(temperature)

    def apply_(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Transform the fp32 tile ``y`` (overwritten) into z; returns (z, tanh(.)), the second where a
        softcap needs it for the derivative (else None)."""
        if self.scale != 1.0:
            y.mul_(self.scale)
        if self.softcap is not None:
            tanh = y.div_(self.softcap).tanh_()
            return tanh.mul(self.softcap * self.inv_t), tanh  # a new z: tanh is kept for the backward
        if self.inv_t != 1.0:
            y.mul_(self.inv_t)
        return y, None

    def backward_(self, grad_z: torch.Tensor, tanh: torch.Tensor | None) -> torch.Tensor:
        """dL/dy from dL/dz, in place on ``grad_z``."""
        factor = self.inv_t * self.scale
        if tanh is not None:
            grad_z.mul_(1.0 - tanh * tanh)  # d softcap*tanh(u / softcap) / du = 1 - tanh^2
        if factor != 1.0:
            grad_z.mul_(factor)
        return grad_z


def _logits_tile(
    products: HalfProducts, hidden_c: torch.Tensor, weight_c: torch.Tensor, bias_c: torch.Tensor | None
) -> torch.Tensor:
    """hidden_c [n, H] @ weight_c [c, H]^T (+ bias_c [c]) -> [n, c] in the compute dtype (operands from
    ``products.operand``): oneDNN in bf16 / fp16 where the CPU has native kernels, fp32 products rounded
    to the compute dtype elsewhere, and in fp32 the backend ``linear`` measured faster here."""
    return products.linear(hidden_c, weight_c, bias_c)


def _as_fp32(tile: torch.Tensor) -> torch.Tensor:
    """An fp32 tile that may be overwritten: a converted copy, or the fp32 tile itself."""
    return tile.float() if tile.dtype != torch.float32 else tile


class _Stats:
    """Online log-sum-exp statistics of rows [n] over vocabulary chunks, all fp32."""

    def __init__(self, n: int, outputs: tuple[str, ...]) -> None:
        self.max = torch.full((n,), -math.inf)
        self.sum_exp = torch.zeros(n)
        self.x_sum_exp = torch.zeros(n) if "entropy" in outputs else None
        self.sq_sum_exp = torch.zeros(n) if "log_sum_sq_probs" in outputs else None
        self.z_sum = torch.zeros(n) if "mean_logits" in outputs else None
        self.argmax = torch.zeros(n, dtype=torch.int64) if "is_top1" in outputs else None
        self.target = torch.zeros(n)

    def fold(self, z: torch.Tensor, local_targets: torch.Tensor, start: int) -> None:
        """Fold the fp32 tile z: [n, c] of columns start..start+c (overwritten)."""
        c = z.shape[1]
        in_tile = (local_targets >= 0) & (local_targets < c)
        picked = z.gather(1, local_targets.clamp(0, c - 1).unsqueeze(1)).squeeze(1)
        self.target = torch.where(in_tile, picked, self.target)
        if self.z_sum is not None:
            self.z_sum += z.sum(1)
        tile_max, tile_argmax = z.max(1)  # the first maximal index of each row
        if self.argmax is not None:  # a later chunk takes over only with a strictly larger maximum
            self.argmax = torch.where(tile_max > self.max, tile_argmax + start, self.argmax)
        new_max = torch.maximum(self.max, tile_max)
        old_w = torch.exp(self.max - new_max)
        tile_w = torch.exp(tile_max - new_max)
        e = (  # exp(z - max) in place, unless the entropy's sum of e * z still needs z
            z.sub_(tile_max.unsqueeze(1)).exp_()
            if self.x_sum_exp is None
            else (z - tile_max.unsqueeze(1)).exp_()
        )
        self.sum_exp = self.sum_exp * old_w + e.sum(1) * tile_w
        if self.sq_sum_exp is not None:
            self.sq_sum_exp = self.sq_sum_exp * old_w * old_w + torch.linalg.vecdot(e, e) * tile_w * tile_w
        if self.x_sum_exp is not None:
            self.x_sum_exp = self.x_sum_exp * old_w + torch.linalg.vecdot(e, z) * tile_w
        self.max = new_max


class CPUChunkedLogProb(torch.autograd.Function):
    """Per-token log-probabilities of ``hidden @ weight.T`` on a CPU, tile by tile (see the module
    docstring). Arguments and outputs as ``trl.kernels.ChunkedLogProbFunction``: ``(hidden [N, H],
    weight [V, H], bias [V] | None, targets [N], temperature, chunk_size, final_logit_softcapping,
    logit_scale, outputs)`` -> ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each
    [N] (None where not requested; log-probabilities always)."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = OPTIONAL_OUTPUTS,
    ):
        ctx.set_materialize_grads(False)
        dtype = compute_dtype_for(hidden)
        products = HalfProducts(dtype)
        transform = Transform(logit_scale, final_logit_softcapping, temperature)
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        weight_c = products.operand(weight)  # once per call: the backward reuses it
        bias_c = products.operand(bias) if bias is not None else None
        width = vocab_chunk(min(n_rows, TOKEN_CHUNK), vocab, chunk_size)
        # One tile for the whole call (a DPO batch of a few hundred completion tokens): keep its logits
        # for the backward instead of computing them again there.
        # (forward runs without grad mode: ask which inputs want a gradient; under no_grad the context and
        # the tile are dropped as soon as apply returns)
        keep_tile = n_rows <= TOKEN_CHUNK and width == vocab and any(ctx.needs_input_grad[:3])
        parts = []
        for t0 in range(0, n_rows, TOKEN_CHUNK):
            t1 = min(t0 + TOKEN_CHUNK, n_rows)
            hidden_c = products.operand(hidden[t0:t1])
            stats = _Stats(t1 - t0, outputs)
            for v0 in range(0, vocab, width):
                v1 = min(v0 + width, vocab)
                bias_chunk = bias_c[v0:v1] if bias_c is not None else None
                tile = _logits_tile(products, hidden_c, weight_c[v0:v1], bias_chunk)
                z, _ = transform.apply_(
                    tile.clone() if keep_tile and tile.dtype == torch.float32 else _as_fp32(tile)
                )
                stats.fold(z, targets[t0:t1] - v0, v0)
            parts.append(stats)

        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(s, name) for s in parts]
            return None if values[0] is None else torch.cat(values)

        max_, sum_exp = cat("max"), cat("sum_exp")
        log_z = max_ + torch.log(sum_exp)
        log_probs = cat("target") - log_z
        entropy = log_z - cat("x_sum_exp") / sum_exp if "entropy" in outputs else None
        log_sum_sq = (
            torch.log(cat("sq_sum_exp")) - 2 * torch.log(sum_exp) if "log_sum_sq_probs" in outputs else None
        )
        mean_logits = cat("z_sum") / vocab if "mean_logits" in outputs else None
        is_top1 = cat("argmax") == targets if "is_top1" in outputs else None

        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy if entropy is not None else log_z)
        ctx.weight_c, ctx.bias_c = weight_c, bias_c
        ctx.tile = tile if keep_tile else None
        ctx.products, ctx.width, ctx.transform = products, width, transform
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean_logits, is_top1) if x is not None))
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_):
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        weight_c, bias_c, kept_tile = ctx.weight_c, ctx.bias_c, ctx.tile
        products, width, transform = ctx.products, ctx.width, ctx.transform
        ctx.weight_c = ctx.bias_c = ctx.tile = None
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32) if need_hidden else None
        # Written by the first token chunk's product (no zero fill of a [V, H] buffer), added to after.
        grad_weight = _uninitialized(weight.shape) if need_weight else None
        grad_bias = torch.zeros(vocab, dtype=torch.float32) if need_bias and bias is not None else None
        if grad_log_probs is None and grad_entropy is None:
            if grad_weight is not None:
                grad_weight.zero_()
            return _cast_grads(grad_hidden, grad_weight, grad_bias, hidden, weight, bias)
        g_lp = grad_log_probs.float() if grad_log_probs is not None else None
        g_ent = grad_entropy.float() if grad_entropy is not None else None
        for t0 in range(0, n_rows, TOKEN_CHUNK):
            t1 = min(t0 + TOKEN_CHUNK, n_rows)
            hidden_c = products.operand(hidden[t0:t1])
            rows = torch.arange(t1 - t0)
            for v0 in range(0, vocab, width):
                v1 = min(v0 + width, vocab)
                if kept_tile is not None:
                    tile = kept_tile
                else:
                    bias_chunk = bias_c[v0:v1] if bias_c is not None else None
                    tile = _logits_tile(products, hidden_c, weight_c[v0:v1], bias_chunk)
                z, tanh = transform.apply_(_as_fp32(tile))
                grad_z = _grad_logits(z, log_z[t0:t1], entropy[t0:t1], g_lp, g_ent, t0, t1)
                if g_lp is not None:  # d log p_t / dz_j = 1[j = t] - p_j: the 1 at the target column
                    local = targets[t0:t1] - v0
                    hit = (local >= 0) & (local < v1 - v0)
                    grad_z[rows[hit], local[hit]] += g_lp[t0:t1][hit]
                grad_y = transform.backward_(grad_z, tanh)
                tile.copy_(grad_y)  # the products run in the compute dtype
                tile_op = products.operand(tile)  # converted once for both products where emulating
                if grad_hidden is not None:
                    grad_hidden[t0:t1] += products.mm(tile_op, weight_c[v0:v1])
                if grad_weight is not None:
                    product = products.mm(tile_op.t(), hidden_c)
                    grad_weight[v0:v1].copy_(product) if t0 == 0 else grad_weight[v0:v1].add_(product)
                if grad_bias is not None:
                    grad_bias[v0:v1] += tile.sum(0, dtype=torch.float32)
        return _cast_grads(grad_hidden, grad_weight, grad_bias, hidden, weight, bias)


def _uninitialized(shape: torch.Size) -> torch.Tensor:
    """An fp32 buffer every element of which the caller writes (tests fill it with NaN to prove that)."""
    return torch.empty(shape, dtype=torch.float32)


def _grad_logits(
    z: torch.Tensor,
    log_z: torch.Tensor,
    entropy: torch.Tensor,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    t0: int,
    t1: int,
) -> torch.Tensor:
    """dL/dz of a tile except the target-column term, in place on z: [n, c] (fp32, overwritten).

    With p = softmax(z): d log p_t / dz_j = 1[j = t] - p_j (the indicator is added by the caller) and
    d H / dz_j = -p_j (log p_j + H)."""
    log_p = z.sub_(log_z.unsqueeze(1))
    p = log_p.exp()
    if g_ent is None:
        return p.mul_(-g_lp[t0:t1].unsqueeze(1))
    grad = log_p.add_(entropy.unsqueeze(1)).mul_(p).mul_(-g_ent[t0:t1].unsqueeze(1))
    if g_lp is not None:
        grad.addcmul_(p, g_lp[t0:t1].unsqueeze(1), value=-1.0)
    return grad


def _cast_grads(grad_hidden, grad_weight, grad_bias, hidden, weight, bias):
    """The gradients in their inputs' dtypes, then None for the six non-tensor arguments."""
    return (
        grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
        grad_weight.to(weight.dtype) if grad_weight is not None else None,
        grad_bias.to(bias.dtype) if grad_bias is not None else None,
        None, None, None, None, None, None,
    )  # fmt: skip
