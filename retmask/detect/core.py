"""Per-test copy counting: the step-by-step oracle and the fast path.

Both return, for one prompt, the greedy answer and ``copies`` [L, Hq]: for every layer and query head the
number of decoding steps t at which the head's most attended key ``j`` (attention row of the token fed at
step t) lies in the needle span and ``prompt[j]`` equals the token ``y_t`` produced at that step
(the copy rule). Decoding: greedy, at most ``max_new_tokens``, stopping after a stop token.
"""

from __future__ import annotations

import contextlib
import numbers
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from retmask.detect.drafts import next_draft_cap, propose_draft
from retmask.detect.kv_only import kv_only
from retmask.detect.prefill_chunk import resolve_prefill_chunk
from retmask.detect.state_snapshots import LayerStates, rewind, take
from retmask.detect.static_passes import BUCKETS, StaticPasses
from retmask.heads import model_shape
from retmask.hf.capture import capture_argmax
from retmask.hf.kv_cache import growing_cache, reserve
from retmask.hf.layers import head_layout
from retmask.hf.patch import require_retmask

# A hybrid model's running states are copied at most this many times per prompt (state_snapshots.py):
# e.g. 32 x 20 MB for 18 gated-DeltaNet layers of 16 value heads of 128 x 128 in float32.
MAX_KEPT_STATES = 32

# (prompt int64 [n], needle span, tokens generated so far, max draft length, earlier answers) -> draft
DraftFn = Callable[[np.ndarray, tuple[int, int], list[int], int, Sequence[list[int]]], list[int]]


@dataclass
class TestOutcome:
    """tokens: the greedy answer (stop token included); copies: int64 [L, Hq] on the host."""

    tokens: list[int]
    copies: np.ndarray
    timings: dict[str, float] = field(default_factory=dict)
    passes: int = 0  # forward calls after the prefill (decode steps or verification passes)
    prefill_tokens: int = 0  # prompt tokens actually computed (the rest came from the shared prefix)


@contextlib.contextmanager
def attn_implementation(model, name: str) -> Iterator[None]:
    """Temporarily switch ``model`` to another attention implementation (KV caches stay valid)."""
    old = model.config._attn_implementation
    if old == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


def _check_prefill_impl(model, name: str) -> None:
    """Refuse, before any test, a prefill implementation transformers has none of for ``model`` (gpt-oss
    has no SDPA path): its own error names a loading flag, not the detection setting to change."""
    try:
        with attn_implementation(model, name):
            pass
    except ValueError as err:
        first = str(err).split(". ")[0]
        raise ValueError(
            f"prefill_impl={name!r} cannot run on this '{model.config.model_type}' model ({first}); use the "
            "default prefill_impl='retmask' (retmask detect: --prefill-impl retmask, or leave the flag out)"
        ) from None


def _finished(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` has run: a CUDA prefill returns before
    its kernels finish, and its time would otherwise be counted in the decode that waits for it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.no_grad()
def oracle_detect(
    model,
    prompt_ids: np.ndarray | list[int],
    span: tuple[int, int],
    stop_ids: Collection[int],
    max_new_tokens: int = 50,
    prefill_impl: str = "sdpa",
    prompt_logits: bool = False,
) -> TestOutcome:
    """Reference-style, step by step: prefill ``prompt[:-1]`` (``prefill_impl``), then feed one token per
    step with eager attention and ``output_attentions=True`` and check every layer and head on the host
    (top-1 key, as the published script does). Slow on purpose: the ground truth for tests and the
    benchmark's baseline.

    ``prompt_logits=True`` computes the logits of every prompt position in the prefill, as the published
    script's plain ``model(input_ids[:, :-1])`` call does (its transformers 4.37 had no ``logits_to_keep``);
    the results are the same, only the cost differs (the benchmark's faithful baseline)."""
    prompt = torch.as_tensor(np.asarray(prompt_ids), dtype=torch.long)
    device = model.device
    num_layers, num_heads = model_shape(model)
    s, e = span
    copies = np.zeros((num_layers, num_heads), dtype=np.int64)
    t0 = time.perf_counter()
    cache = _new_cache(model)
    with attn_implementation(model, prefill_impl):
        keep = 0 if prompt_logits else 1  # 0 = all positions
        model(
            input_ids=prompt[None, :-1].to(device),
            cache=cache,
            use_cache=True,
            logits_to_keep=keep,
        )
    t1 = _finished(device)
    tokens: list[int] = []
    x = prompt[-1:]
    with attn_implementation(model, "eager"):
        for _ in range(max_new_tokens):
            out = model(
                input_ids=x[None].to(device),
                cache=cache,
                use_cache=True,
                output_attentions=True,
            )
            y = int(out.logits[0, -1].argmax())
            tokens.append(y)
            seen = cache.get_seq_length()  # tokens so far; a sliding-window layer's cache holds the last K
            for layer in range(num_layers):
                att = out.attentions[layer]  # [1, Hq, 1, K]
                offset = seen - att.shape[-1]  # absolute position of the layer's first cached key
                for head in range(num_heads):
                    j = offset + int(att[0, head, -1].topk(1).indices[0])
                    if s <= j < e and int(prompt[j]) == y:
                        copies[layer, head] += 1
            if y in stop_ids:
                break
            x = torch.tensor([y])
    t2 = time.perf_counter()
    return TestOutcome(
        tokens, copies, {"prefill_s": t1 - t0, "decode_s": t2 - t1}, len(tokens), len(prompt) - 1
    )


def _crop_to(cache, length: int) -> None:
    """Keep the first ``length`` positions of a DynamicCache (transformers 5 ``crop`` takes a negative
    number of tokens to remove)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class FastDetector:
    """The fast path, one model, many tests, one KV cache carried across tests.

    * Shared prefixes: the cache keeps the KV of the previous prompt; a new test reuses the longest common
      prefix, computed in chunks aligned to absolute multiples of ``chunk`` positions and reused only in
      whole chunks, so every KV entry is computed by the same call shapes whatever ran before: a test's
      result does not depend on the order of tests (resume and sharding reproduce it exactly).
    * No logits in the prefill (the LM head returns zeros, ``logits_to_keep=1`` keeps them one row), and
      of the last layer it computes only the K/V (``kv_only.kv_only``): nothing reads its outputs.
    * Greedy answer by prompt-lookup verification: feed ``[x, d_1..d_k]``, accept the longest draft prefix
      equal to the greedy tokens plus one; the argmax of the accepted rows is captured in the same pass by
      the fused kernel (``retmask.capture_argmax``) and checked against the tokens on the device; counts
      accumulate in an [L, Hq] tensor read once per test. ``run(..., history=...)`` lets the drafts reuse
      the model's earlier answers to the same needle.
    * The cache appends in place (``kv_cache.GrowingLayer``): no copy of the whole cache per pass.
    * A hybrid model (convolution, linear-attention or Mamba layers besides the attention layers) keeps
      running states in its cache that cannot be cut back to an earlier position: the prefill keeps a copy
      of them at chunk boundaries (``state_snapshots``; every chunk, or every few chunks so that a prompt
      keeps at most ``MAX_KEPT_STATES``), so shared prefixes are reused as above. A
      pass with a draft keeps them too: when a draft token is rejected, the states go back to before the
      pass and the accepted rows are fed again (one more pass, whose outputs are not read). Same answers
      and counts.
    * ``static_passes=True``: verification passes of fixed shapes (a scratch tail in the cache, passes
      padded to a few sizes; ``static_passes.py``), replayed from CUDA graphs on a GPU, where a pass is
      otherwise bound by the host issuing its kernels. Same answers and counts; off by default until timed.
    """

    def __init__(
        self,
        model,
        stop_ids: Collection[int],
        max_new_tokens: int = 50,
        chunk: int | None = None,
        draft_fn: DraftFn = propose_draft,
        max_draft: int = 64,
        prefill_impl: str = "retmask",
        count_copies: bool = True,
        min_draft: int = 8,
        static_passes: bool = False,
    ):

        require_retmask(model, "retmask detect's fast path")
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, numbers.Integral)
            or max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        self.model = model
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.max_new_tokens = max_new_tokens
        # None: the device's default (256 tokens on a CPU, 4096 on a GPU; see ``prefill_chunk``)
        self.chunk = resolve_prefill_chunk(chunk, model.device)
        self.draft_fn = draft_fn
        self.max_draft = max_draft
        self.min_draft = min_draft
        self.prefill_impl = prefill_impl
        if prefill_impl != "retmask":
            _check_prefill_impl(model, prefill_impl)
        # False: answers only (NIAH evaluation) -- no argmax capture, ``copies`` stays all zero.
        self.count_copies = count_copies
        layout = head_layout(model)
        self.layout = layout.shape
        # A hybrid's cache holds running states, rewound through copies (see the class docstring).
        self.hybrid = layout.hybrid
        self.states: dict[int, list[LayerStates]] = {}  # hybrid: position -> running states there
        if self.hybrid:
            if static_passes:
                raise ValueError(
                    f"static_passes needs a cache of attention layers only; '{model.config.model_type}' is a "
                    "hybrid model (its other layers keep running states, which fixed-shape passes do not "
                    "rewind): leave it off"
                )
        # Fixed-shape verification passes (``static_passes``), replayed from CUDA graphs on a GPU.
        if static_passes and max_draft + 1 > BUCKETS[-1]:
            raise ValueError(f"static_passes takes max_draft <= {BUCKETS[-1] - 1}, got {max_draft}")
        self.static = StaticPasses(model) if static_passes else None
        self.cache = None
        self.cached = np.zeros(0, dtype=np.int64)  # token ids whose KV is in self.cache (whole chunks)

    def reset(self) -> None:
        self.cache = None
        self.cached = np.zeros(0, dtype=np.int64)
        self.states = {}

    @torch.no_grad()
    def _prefill(self, prefix: np.ndarray) -> int:
        """Bring the cache to exactly ``prefix`` (int64 [m]); returns the number of tokens computed."""
        device = self.model.device
        keep = (_lcp(self.cached, prefix) // self.chunk) * self.chunk
        if self.hybrid:  # back to the last position whose running states were kept
            keep = max((p for p in self.states if p <= keep), default=0)
        if self.cache is None or (self.hybrid and keep == 0):
            self.cache = growing_cache(self.model) if self.static is None else self.static.new_cache()
            self.states = {}
            keep = 0
        elif self.hybrid:
            rewind(self.cache, keep, self.states[keep])
            self.states = {p: states for p, states in self.states.items() if p <= keep}
        else:
            _crop_to(self.cache, keep)
        # The longest this test can make the cache: its prompt and every decoded token (a pass feeds at
        # most the remaining budget). Buffers are allocated at that size, never by doubling.
        longest = len(prefix) + 1 + self.max_new_tokens
        if self.static is None:
            reserve(self.cache, longest)
        else:  # a fixed buffer with room for the passes' tail, grown now if this test needs more
            self.static.ensure_capacity(longest)
        ids = torch.as_tensor(prefix, dtype=torch.long, device=device)
        # A hybrid keeps its running states at most MAX_KEPT_STATES times per prompt (their memory), at
        # multiples of whole chunks: a long prompt is reused in coarser steps.
        chunks = -(-len(prefix) // self.chunk)
        state_every = self.chunk * max(1, -(-chunks // MAX_KEPT_STATES))
        # The prefill needs no argmax: any attention implementation may compute it (``prefill_impl``). Its
        # outputs are discarded, so the last layer only writes its K/V and the LM head is skipped (``kv_only``).
        with attn_implementation(self.model, self.prefill_impl), kv_only(self.model):
            for a in range(keep, len(prefix), self.chunk):
                b = min(len(prefix), a - a % self.chunk + self.chunk)
                self.model(
                    input_ids=ids[None, a:b],
                    cache=self.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                if self.hybrid and b % state_every == 0:
                    self.states[b] = take(self.cache)
        self.cached = prefix
        return len(prefix) - keep

    @torch.no_grad()
    def run(
        self,
        prompt_ids: np.ndarray | list[int],
        span: tuple[int, int],
        history: Sequence[list[int]] = (),
    ) -> TestOutcome:
        """One test. ``history``: the model's earlier answers (token lists, oldest first) to the same
        needle, used only for drafts (the answer is the greedy one whatever they are). A test's result
        depends only on its prompt and ``history`` (not on the cache's previous contents)."""

        prompt = np.asarray(prompt_ids, dtype=np.int64)
        n = len(prompt)
        device = self.model.device
        s, e = span
        t0 = time.perf_counter()
        computed = self._prefill(prompt[:-1])
        t1 = _finished(device)
        # Only full chunks of the prompt may stay in the cache for the next test (see class docstring);
        # remember where the prompt ends so the decode tokens can be cropped away afterwards.
        base = n - 1
        prompt_t = torch.as_tensor(prompt, device=device)
        counts = torch.zeros(self.layout, dtype=torch.int64, device=device)
        tokens: list[int] = []
        x = int(prompt[-1])
        passes = 0
        # Draft length cap: a rejected draft costs its rows for nothing, so after a rejection at position a
        # the next draft is at most max(min_draft, 2a) long; a fully accepted draft restores the maximum.
        # On 2 CPU cores a SmolLM2 pass costs about 29-34 ms + 5-7 ms per 1K cached tokens + 1.1-1.6 ms
        # per row (fitted on two runs of the default grid's 96 tests, R^2 >= 0.996). min_draft = 2 was
        # measured worse than 8 on the benchmark grid (+12% passes, +25% decode time): after a rejection the
        # model often resumes copying the needle, and a longer draft catches that in the same pass. Replays
        # of the default grid's recorded answers through that cost model put 6-8 at the optimum
        # (2: +4-5% decode, 16: +4-5%; bench/replay_drafts.py).
        draft_cap = self.max_draft
        stopped = False
        # One capture for all of the test's passes, every row of each: entering one per pass walked the
        # model's modules every time (about 1.7 ms of host time per pass for a 30-layer model).
        capture = capture_argmax(self.model, rows=None) if self.count_copies else contextlib.nullcontext()
        with capture as cap:
            while not stopped and len(tokens) < self.max_new_tokens:
                remaining = self.max_new_tokens - len(tokens)
                limit = min(remaining - 1, draft_cap)
                draft = self.draft_fn(prompt, span, tokens, limit, history)[:limit]
                past = self.cache.get_seq_length()
                # a hybrid's running states before a pass with a draft, to undo rejected draft tokens
                before = take(self.cache) if self.hybrid and draft else None
                if self.static is None:
                    inp = torch.tensor([[x, *draft]], dtype=torch.long, device=device)
                    logits = self.model(input_ids=inp, cache=self.cache, use_cache=True).logits[0]
                    argmax = None if cap is None else cap.last[:, 0]  # int64 [L, Hq, rows of the pass]
                else:
                    logits, argmax = self.static.run([x, *draft], cap)
                passes += 1
                greedy = logits.argmax(-1).tolist()  # one host read per pass: the accepted length
                accepted = 0
                while accepted < len(draft) and draft[accepted] == greedy[accepted]:
                    accepted += 1
                new = greedy[: accepted + 1]
                draft_cap = next_draft_cap(accepted, len(draft), self.max_draft, self.min_draft)
                for i, tok in enumerate(new):
                    if tok in self.stop_ids:
                        new = new[: i + 1]
                        stopped = True
                        break
                rows = len(new)
                if argmax is not None:
                    # Row r of this pass is the attention row of the token fed at decode step len(tokens) + r.
                    idx = argmax[..., :rows]  # int64 [L, Hq, rows], absolute key positions
                    cap.calls.clear()  # only this pass's argmax is needed
                    ys = torch.tensor(new, dtype=torch.long, device=device)
                    hit = (idx >= s) & (idx < e) & (prompt_t[idx.clamp(0, n - 1)] == ys)
                    counts += hit.sum(-1)
                tokens += new
                if self.static is not None:
                    self.static.commit(rows)
                elif before is None:
                    _crop_to(self.cache, past + rows)  # drop the KV of rejected draft tokens
                elif rows < len(draft) + 1 and not stopped and len(tokens) < self.max_new_tokens:
                    # The running states took in the rejected draft tokens too: back to before the pass,
                    # then the accepted rows again (their outputs are known; only the states are needed).
                    rewind(self.cache, past, before)
                    self.model(
                        input_ids=inp[:, :rows], cache=self.cache, use_cache=True,
                        logits_to_keep=1,
                    )  # fmt: skip
                    passes += 1
                x = new[-1]
        if not self.hybrid:  # a hybrid's next prefill rewinds through its kept states instead
            _crop_to(self.cache, base)
        copies = counts.cpu().numpy()  # the one read of the counts per test
        t2 = time.perf_counter()
        return TestOutcome(tokens, copies, {"prefill_s": t1 - t0, "decode_s": t2 - t1}, passes, computed)
