"""The fast path (prompt-lookup verification, fused-kernel argmax, KV-prefix reuse) gives exactly the
step-by-step oracle's answers and per-head copy counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retmask.detect import FastDetector, oracle_detect, stop_token_ids
from retmask.detect.core import attn_implementation
from retmask.detect.drafts import propose_draft
from retmask.niah import build_tests, default_haystack_text, load_needles
from tests.tiny import tiny_llama


def tiny_prompts(seed: int = 0, vocab: int = 16):
    """Prompts sharing long prefixes (like tests of one needle at several depths), needle span inside."""
    rng = np.random.default_rng(seed)
    hay = rng.integers(3, vocab, size=300)
    needle = rng.integers(3, vocab, size=12)
    out = []
    for p in (0, 40, 150, 151, 260):
        prompt = np.concatenate([[1], hay[:p], needle, hay[p : 200 + p // 2], [4, 5]])
        out.append((prompt.astype(np.int64), (1 + p, 1 + p + 12)))
    return out


def random_draft(seed):
    rng = np.random.default_rng(seed)

    def draft(prompt, span, generated, max_len, history):
        # mixes good drafts (prompt lookup) with garbage, to exercise partial acceptance and rejection
        d = propose_draft(prompt, span, generated, max_len, history)
        if rng.random() < 0.5:
            d = rng.integers(3, 16, size=min(max_len, int(rng.integers(0, 8)))).tolist()
        return d

    return draft


@pytest.fixture(scope="module")
def tiny_oracle():
    model = tiny_llama()
    prompts = tiny_prompts()
    want = [oracle_detect(model, p, s, {2}, max_new_tokens=30, prefill_impl="retmask") for p, s in prompts]
    return model, prompts, want


@pytest.mark.parametrize(
    "chunk, static_passes", [(16, False), (64, False), (4096, False), (16, True), (4096, True)]
)
def test_tiny_random_llama_fast_equals_oracle(chunk, static_passes, tiny_oracle):
    """static_passes: fixed-shape verification passes (a scratch tail in the cache, padded passes;
    replayed from CUDA graphs when the tests run on a GPU)."""
    model, prompts, oracle = tiny_oracle
    stops = {2}
    order = list(range(len(prompts)))
    for draft_fn in (propose_draft, random_draft(chunk)):
        fast = FastDetector(
            model, stops, max_new_tokens=30, chunk=chunk, draft_fn=draft_fn, static_passes=static_passes
        )
        total = 0
        for i in order + order[::-1]:  # both orders: prefix reuse in both directions
            (prompt, span), want = prompts[i], oracle[i]
            got = fast.run(prompt, span)
            assert got.tokens == want.tokens
            np.testing.assert_array_equal(got.copies, want.copies)
            total += int(want.copies.sum())
        assert total > 0, "the tiny model should copy sometimes, or this test proves nothing"


def test_tiny_history_drafts_equal_oracle(tiny_oracle):
    """Earlier answers only change the drafts: exact, partial, foreign or garbage histories all give the
    oracle's answers and copy counts; the test's own answer as history needs one pass."""
    model, prompts, oracle = tiny_oracle
    rng = np.random.default_rng(3)
    fast = FastDetector(model, {2}, max_new_tokens=30, chunk=64)
    garbage = [rng.integers(3, 16, size=25).tolist() for _ in range(3)]
    for k, ((prompt, span), want) in enumerate(zip(prompts, oracle, strict=True)):
        own = want.tokens
        half = own[: len(own) // 2] + rng.integers(3, 16, size=10).tolist()
        others = [w.tokens for j, w in enumerate(oracle) if j != k]
        for history in ([own], [half], [half, own, half], others, garbage, garbage + [own]):
            got = fast.run(prompt, span, history)
            assert got.tokens == want.tokens
            np.testing.assert_array_equal(got.copies, want.copies)
            if history == [own]:
                assert got.passes == 1


def test_tiny_sdpa_prefill_equals_oracle(tiny_oracle):
    model, prompts, oracle = tiny_oracle
    fast = FastDetector(model, {2}, max_new_tokens=30, chunk=32, prefill_impl="sdpa")
    for (prompt, span), want in zip(prompts, oracle, strict=True):
        got = fast.run(prompt, span)
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(got.copies, want.copies)
    assert model.config._attn_implementation == "retmask"


def test_a_prefill_implementation_the_model_lacks_is_refused_by_its_setting():
    """gpt-oss has no SDPA path in transformers: refused when the detector is built, naming the setting to
    change (transformers' own error names a loading flag), and the model stays on retmask attention."""
    from tests.hf.test_attention_features import feature_model

    model = feature_model("gpt_oss")
    with pytest.raises(
        ValueError, match=r"prefill_impl='sdpa' cannot run on this 'gpt_oss' model .*--prefill-impl retmask"
    ):
        FastDetector(model, {2}, max_new_tokens=4, prefill_impl="sdpa")
    assert model.config._attn_implementation == "retmask"


def _top2_margin_in_bf16_ulps(model, prompt: np.ndarray, answer: list[int]) -> float:
    """Gap between the two largest next-token logits after ``prompt + answer`` (an eager bf16 forward), in
    units of the bf16 spacing at the largest one (2^-7 relative)."""
    seq = torch.as_tensor(np.concatenate([prompt, np.asarray(answer, dtype=np.int64)]), device=model.device)
    with torch.no_grad(), attn_implementation(model, "eager"):
        top = model(input_ids=seq[None]).logits[0, -1].float().topk(2).values
    ulp = 2.0 ** (torch.floor(torch.log2(top[0].abs())) - 7)
    return float((top[0] - top[1]) / ulp)


@pytest.mark.parametrize("path", ["cpp", "bf16dot"])
def test_tiny_bf16_fast_equals_oracle_up_to_bf16_near_ties(path, monkeypatch):
    """Both sides in bf16 (weights, activations, caches), with the CPU kernel on its fp32-converting path
    ("cpp") and on bf16 dot products ("bf16dot", P rounded to bf16: what bf16 prefill runs on CPUs with
    AVX512-BF16; emulated elsewhere). They do different bf16 arithmetic (eager rounds
    QK^T and the probabilities to bf16, the kernel keeps fp32 logits; a pass of k rows is not k passes of
    one), so a greedy answer may take another token where the top two logits are within bf16 rounding.
    Proven here: every test either matches the oracle exactly (answer and per-head copy counts), or
    matches it exactly up to the step where the answers part (both stopped there), and that step is a
    near-tie: top-2 gap <= 16 bf16 ulps (on these models 17% of all steps are that close, so a few
    divergences landing there by chance is unlikely; eager, SDPA and the kernel disagree there too)."""
    monkeypatch.setenv("RETMASK_CPU_PATH", path)
    exact = diverged = 0
    for seed in range(4):
        model = tiny_llama(seed=seed).to(torch.bfloat16)
        for prompt, span in tiny_prompts(seed):
            want = oracle_detect(model, prompt, span, {2}, max_new_tokens=30, prefill_impl="retmask")
            got = FastDetector(model, {2}, max_new_tokens=30, chunk=16).run(prompt, span)
            if got.tokens == want.tokens:
                np.testing.assert_array_equal(got.copies, want.copies)
                exact += 1
                continue
            diverged += 1
            k = next(i for i, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=False)) if a != b)
            if k:
                want_k = oracle_detect(model, prompt, span, {2}, max_new_tokens=k, prefill_impl="retmask")
                got_k = FastDetector(model, {2}, max_new_tokens=k, chunk=16).run(prompt, span)
                assert got_k.tokens == want_k.tokens == want.tokens[:k]
                np.testing.assert_array_equal(got_k.copies, want_k.copies)
            margin = _top2_margin_in_bf16_ulps(model, prompt, want.tokens[:k])
            assert margin <= 16, f"seed {seed}: answers part at step {k} with a top-2 gap of {margin} ulps"
    assert exact >= 12 and diverged <= 8, (exact, diverged)


def test_tiny_fast_equals_oracle_on_onednn_linears(monkeypatch):
    """The linears on oneDNN (what the CPU speed-ups pick where it is faster): the oracle's single rows run
    its matrix-vector kernel, the fast path's verification passes its matrix kernel, and still every
    answer and copy count is the oracle's."""
    from retmask.cpu_speedups import linear
    from retmask.hf.linears import patch_linears

    monkeypatch.setattr(linear, "backend_for", lambda case: "onednn")
    model = tiny_llama(seed=1)
    assert patch_linears(model) > 0
    copied = 0
    for prompt, span in tiny_prompts(seed=1):
        want = oracle_detect(model, prompt, span, {2}, max_new_tokens=30, prefill_impl="retmask")
        got = FastDetector(model, {2}, max_new_tokens=30, chunk=16).run(prompt, span)
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(got.copies, want.copies)
        copied += int(want.copies.sum())
    assert copied > 0


def test_tiny_stops_after_stop_token_and_respects_budget():
    model = tiny_llama()
    prompt, span = tiny_prompts()[1]
    free = oracle_detect(model, prompt, span, set(), max_new_tokens=12)
    assert len(free.tokens) == 12
    stop = free.tokens[5]
    fast = FastDetector(model, {stop}, max_new_tokens=12).run(prompt, span)
    first = free.tokens.index(stop)
    assert fast.tokens == free.tokens[: first + 1]


@pytest.fixture(scope="module")
def embedded_oracle(embedded):
    """4 NIAH tests of the embedded model (2 needles, 420 / 700 tokens) with the step-by-step oracle's
    answers, computed once for both fast-path variants below (the oracle is most of their time)."""
    model, tok = embedded
    tests = build_tests(tok, load_needles()[:2], default_haystack_text(), [420, 700], [0, 50])
    stops = stop_token_ids(tok, model)
    return stops, [(t, oracle_detect(model, t.prompt_ids, t.span, stops)) for t in tests[:3] + tests[-1:]]


@pytest.mark.embedded
@pytest.mark.parametrize("static_passes", [False, True])
def test_embedded_model_fast_equals_oracle(embedded, embedded_oracle, static_passes):
    model, _ = embedded
    stops, answered = embedded_oracle
    fast = FastDetector(model, stops, chunk=128, static_passes=static_passes)
    copied = 0
    for t, want in answered:
        got = fast.run(t.prompt_ids, t.span)
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(got.copies, want.copies)
        assert got.passes < len(got.tokens)  # verification accepted multi-token drafts
        copied += int(want.copies.sum())
    assert copied > 0


@pytest.mark.embedded
def test_embedded_model_fast_equals_oracle_on_onednn_linears(embedded, monkeypatch):
    """The embedded model as ``retmask detect`` runs it where oneDNN's fp32 linears are faster."""
    from retmask.cpu_speedups import linear

    monkeypatch.setattr(linear, "backend_for", lambda case: "onednn")
    model, tok = embedded
    tests = build_tests(tok, load_needles()[2:3], default_haystack_text(), [600], [30, 80])
    stops = stop_token_ids(tok, model)
    fast = FastDetector(model, stops, chunk=128)
    for t in tests:
        want = oracle_detect(model, t.prompt_ids, t.span, stops)
        got = fast.run(t.prompt_ids, t.span)
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(got.copies, want.copies)
        assert int(want.copies.sum()) > 0


def tiny_local_global(window: int = 24):
    """A tiny random Gemma 3 (local/global layers, QK-norm) whose window is far shorter than the prompts."""
    import torch
    import transformers

    import retmask

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "gemma3_text", vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        initializer_range=0.2, sliding_window=window, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    return retmask.patch(model)


def assert_fast_equals_oracle(model, prompts) -> None:
    """The fast path's answers and copy counts equal the oracle's on ``prompts`` run in both orders (prefix
    reuse both ways: some prompt tokens come from the cache), 20 new tokens at most; the model copies at
    least once."""
    fast = FastDetector(model, {2}, max_new_tokens=20, chunk=64)
    total = reused = 0
    for prompt, span in prompts + prompts[::-1]:
        want = oracle_detect(model, prompt, span, {2}, max_new_tokens=20, prefill_impl="retmask")
        got = fast.run(prompt, span)
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(got.copies, want.copies)
        total += int(want.copies.sum())
        reused += len(prompt) - 1 - got.prefill_tokens
    assert total > 0, "the tiny model should copy sometimes, or this test proves nothing"
    assert reused > 0, "the prompts share prefixes: the cache should have served some of them"


def test_local_global_model_fast_equals_oracle():
    """Sliding-window layers: the oracle reads eager weights over the last window - 1 cached keys (mapped
    back to absolute positions), the fast path keeps every key and lets the kernel apply the window."""
    model = tiny_local_global()
    rng = np.random.default_rng(1)
    hay, needle = rng.integers(3, 16, size=300), rng.integers(3, 16, size=12)
    prompts = []
    for p, tail in ((0, 4), (40, 10), (150, 30), (151, 150), (260, 8)):  # needle inside / outside the window
        prompt = np.concatenate([[1], hay[:p], needle, hay[p : p + tail], [4, 5]]).astype(np.int64)
        prompts.append((prompt, (1 + p, 1 + p + 12)))
    assert_fast_equals_oracle(model, prompts)


def test_fast_detector_cache_holds_no_more_than_the_longest_test_needs():
    from retmask.detect import FastDetector

    model = tiny_llama()
    fast = FastDetector(model, {2}, max_new_tokens=30, chunk=64)
    longest = 0
    for prompt, span in tiny_prompts():
        fast.run(prompt, span)
        longest = max(longest, len(prompt) + 30)
        for layer in fast.cache.layers:
            assert layer._key_buffer.shape[-2] <= longest


# the seed of the random weights, where seed 0 gives a model that never copies on these prompts
COPYING_SEED = {"qwen3_5_text": 1, "qwen3_next": 1, "nemotron_h": 1, "deepseek_v2": 3, "minicpm3": 0}


@pytest.mark.parametrize(
    "arch",
    [
        "gpt2",
        "gpt_neox",
        "mistral3",
        "lfm2",
        "qwen3_5_text",
        "qwen3_next",
        "nemotron_h",
        "deepseek_v2",
        "minicpm3",
    ],
)
def test_other_architectures_fast_equals_oracle(arch):
    """Detection on attention modules built unlike Llama's (GPT-2: Conv1D projections and learned positions;
    GPT-NeoX: fused QKV, partial rotary, an output projection named "dense"), on a vision-language
    model's language model (Mistral 3, text only) and on hybrid models (attention layers between
    convolution, gated-DeltaNet and Mamba-2 layers: shared prefixes through copies of those layers'
    states, one token per pass, the prefill in chunks continuing the states) and on multi-head latent attention (DeepSeek-V2,
    MiniCPM3: query / key and value heads of different widths, a cache of compressed latents): the
    oracle's answers and copy counts."""
    import transformers

    import retmask
    from tests.hf.conftest import tiny_config
    from tests.hf.test_architectures import HYBRIDS, LATENT, VISION_LANGUAGE

    torch.manual_seed(COPYING_SEED.get(arch, 0))
    if arch in VISION_LANGUAGE:
        # image token 19: never in the prompts (ids 1..15)
        model = transformers.AutoModelForImageTextToText.from_config(VISION_LANGUAGE[arch](vocab=20))
    else:
        config = tiny_config(
            arch, vocab_size=16, max_position_embeddings=1024, **{**HYBRIDS, **LATENT}.get(arch, {})
        )
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert_fast_equals_oracle(retmask.patch(model.eval()), tiny_prompts(seed=2))


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5_text"])
def test_hybrid_drafts_equal_oracle(arch):
    """Drafts on a hybrid: a rejected draft token has entered the convolution / gated-DeltaNet states, which
    go back to before the pass (the accepted rows fed again). Garbage and half-right histories reject
    drafts; the test's own answer as history is accepted whole in one pass."""
    import transformers

    import retmask
    from tests.hf.conftest import tiny_config
    from tests.hf.test_architectures import HYBRIDS

    torch.manual_seed(COPYING_SEED.get(arch, 0))
    config = tiny_config(arch, vocab_size=16, max_position_embeddings=1024, **HYBRIDS[arch])
    model = retmask.patch(transformers.AutoModelForCausalLM.from_config(config).eval())
    rng = np.random.default_rng(4)
    fast = FastDetector(model, {2}, max_new_tokens=20, chunk=64)
    for prompt, span in tiny_prompts(seed=2)[:3]:
        want = oracle_detect(model, prompt, span, {2}, max_new_tokens=20, prefill_impl="retmask")
        own = want.tokens
        half = own[: len(own) // 2] + rng.integers(3, 16, size=10).tolist()
        for history in ([own], [half], [rng.integers(3, 16, size=25).tolist()]):
            got = fast.run(prompt, span, history)
            assert got.tokens == want.tokens
            np.testing.assert_array_equal(got.copies, want.copies)
            if history == [own]:
                assert got.passes == 1


def test_hybrid_keeps_at_most_max_kept_states_per_prompt():
    """A 299-token prefill in 8-token chunks (38 chunks) keeps LFM2's convolution states every 2 chunks (at
    most MAX_KEPT_STATES = 32 copies); a prompt sharing its first 100 tokens resumes from position 96,
    the last kept one, and still equals the oracle."""
    import transformers

    import retmask
    from retmask.detect import state_snapshots
    from retmask.detect.core import MAX_KEPT_STATES
    from tests.hf.conftest import tiny_config
    from tests.hf.test_architectures import HYBRIDS

    torch.manual_seed(0)
    config = tiny_config("lfm2", vocab_size=16, max_position_embeddings=1024, **HYBRIDS["lfm2"])
    model = retmask.patch(transformers.AutoModelForCausalLM.from_config(config).eval())
    rng = np.random.default_rng(5)
    first = rng.integers(3, 16, size=300)
    second = np.concatenate([first[:100], rng.integers(3, 16, size=150)])
    fast = FastDetector(model, {2}, max_new_tokens=8, chunk=8)
    fast.run(first, (10, 20))
    assert sorted(fast.states) == list(range(16, 299, 16)) and len(fast.states) <= MAX_KEPT_STATES
    # every kept tensor is a clone with a storage of its own: their storages are what the states hold
    kept = [t for layer in fast.states[96] if layer for part in layer[:2] for t in part.values()]
    kept += [layer[2] for layer in fast.states[96] if layer and layer[2] is not None]
    assert kept and state_snapshots.nbytes(fast.states[96]) == sum(t.untyped_storage().nbytes() for t in kept)
    got = fast.run(second, (10, 20))
    want = oracle_detect(model, second, (10, 20), {2}, max_new_tokens=8, prefill_impl="retmask")
    assert got.prefill_tokens == len(second) - 1 - 96
    assert got.tokens == want.tokens
    np.testing.assert_array_equal(got.copies, want.copies)
