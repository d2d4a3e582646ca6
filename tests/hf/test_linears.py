"""``patch_linears``: a model's nn.Linear layers on retmask's float32 CPU linear (oneDNN or the few-row kernel
forced here) give torch's logits, generations and gradients; the swap keeps parameters, state dict, hooks, deep copies and
subclasses intact and can be undone; ``load_model`` applies it on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from retmask.cpu_speedups import half_matmul
from retmask.cpu_speedups import linear as linear_cpu
from retmask.hf.linears import CPULinear, decide_linears, patch_linears, torch_linears, unpatch_linears

from .conftest import random_batch, tiny_model


@pytest.fixture
def onednn(monkeypatch):
    monkeypatch.setattr(linear_cpu, "backend_for", lambda case: "onednn")
    calls = []
    real = linear_cpu._onednn_forward
    monkeypatch.setattr(linear_cpu, "_onednn_forward", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.fixture(params=["onednn", "retmask"])
def other_backend(request, monkeypatch):
    """oneDNN for every call, or retmask's few-row kernel where it is a candidate (the decode steps of a
    small batch) and torch's elsewhere; the calls of the forced backend are counted."""
    backend = request.param
    monkeypatch.setattr(linear_cpu, "backend_for",
                        lambda case: backend if backend == "onednn" or case.kind in ("gemv", "few") else "torch")  # fmt: skip
    calls = []
    name = "_onednn_forward" if backend == "onednn" else "_rows_forward"
    real = getattr(linear_cpu, name)
    monkeypatch.setattr(linear_cpu, name, lambda *a: calls.append(1) or real(*a))
    return calls


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_patch_swaps_plain_linears_only_and_undoes():
    model = tiny_model("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    n = len(_linears(model))

    class LoRALike(torch.nn.Linear):
        pass

    model.model.layers[0].mlp.extra = LoRALike(4, 4)  # a subclass: left alone
    assert patch_linears(model) == n
    assert all(type(m) is CPULinear for m in _linears(model) if not isinstance(m, LoRALike))
    assert type(model.model.layers[0].mlp.extra) is LoRALike
    del model.model.layers[0].mlp.extra
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    copied = copy.deepcopy(model)  # TRL copies the policy for its reference model
    assert type(copied.lm_head) is CPULinear and copied.lm_head.weight is not model.lm_head.weight
    with torch_linears(model):
        assert all(type(m) is torch.nn.Linear for m in _linears(model))
    assert type(model.lm_head) is CPULinear
    assert unpatch_linears(model) == n and all(type(m) is torch.nn.Linear for m in _linears(model))


def test_patched_model_gives_torch_logits_generation_and_gradients(other_backend):
    model = tiny_model("llama")
    plain = copy.deepcopy(model)
    patch_linears(model)
    ids, mask = random_batch(3, 14, left_pad=[0, 3, 6], seed=2)
    hooked = []
    model.lm_head.register_forward_hook(lambda m, i, o: hooked.append(o.shape))
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = plain(input_ids=ids, attention_mask=mask).logits
    assert hooked == [got.shape]
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(
            model.generate(input_ids=ids, attention_mask=mask, **kw),
            plain.generate(input_ids=ids, attention_mask=mask, **kw),
        )
    assert other_backend, "the forced backend never ran"
    model.train(), plain.train()
    for m in (model, plain):
        m(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(~valid, -100)).loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.fixture
def measured(monkeypatch):
    """Every case ``linear`` measures (its decision: torch's), with the decisions in memory forgotten before
    and after, so that neither another test's nor these fake ones leak."""
    linear_cpu.clear_memory()
    cases = []
    monkeypatch.setattr(linear_cpu, "candidates", lambda case: ("torch", "onednn"))
    monkeypatch.setattr(linear_cpu, "choose", lambda case: cases.append(case) or {"backend": "torch"})
    yield cases
    linear_cpu.clear_memory()


@pytest.mark.parametrize(
    "dtype,native", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)]
)
def test_decide_linears_leaves_no_measurement_to_the_calls(measured, monkeypatch, dtype, native):
    """decide_linears measures each layer shape's forward cases once (float32: one row, a few, many; bf16:
    one and a few, and on a CPU without native bf16 the float32 products of many rows), and afterwards
    calls of one, a few and many rows of a patched model measure nothing."""
    monkeypatch.setattr(half_matmul, "native_half_matmul", lambda dtype: native)
    monkeypatch.setattr("retmask.hf.linears.native_half_matmul", lambda dtype: native)
    model = tiny_model("llama").cpu().to(dtype)
    patch_linears(model)
    threads = torch.get_num_threads()
    kinds = [("gemv", dtype), ("few", dtype), ("gemm", dtype)]
    if dtype == torch.bfloat16:
        kinds = kinds[:2] + ([] if native else [("gemm", torch.float32)])
    want = {
        linear_cpu.LinearCase(
            m.out_features, m.in_features, m.bias is not None, kind, threads, linear_cpu.DTYPES[dt]
        )
        for m in _linears(model)
        for kind, dt in kinds
    }
    decided = decide_linears(model)
    assert set(measured) == want and len(measured) == len(want)
    assert decided == {case.name(): "torch" for case in want}
    measured.clear()
    with torch.no_grad():
        for batch, seq in ((1, 1), (1, 5), (2, 24)):  # one row, a few, many (>= EMULATE_MIN_ROWS)
            model(input_ids=random_batch(batch, seq)[0].cpu())
    assert measured == []
    assert decide_linears(model) == decided and measured == []  # memoised: nothing measured again


def test_bf16_autocast_training_still_casts(onednn, monkeypatch):
    """Under CPU autocast, on a CPU with native bf16, the patched layers must run F.linear (autocast casts
    it to bf16), never fp32."""
    monkeypatch.setattr(half_matmul, "native_half_matmul", lambda dtype: True)
    model = tiny_model("llama")
    patch_linears(model)
    ids, _ = random_batch(2, 8)
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    onednn.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
    assert seen == [torch.bfloat16] and not onednn


def test_bf16_on_a_cpu_without_native_bf16_runs_emulated_linears(monkeypatch):
    """On a CPU where torch emulates bf16 matmuls, the patched layers multiply the rounded operands in
    fp32: an autocast training step gives torch's bf16 loss and gradients (up to bf16 rounding), and so
    does a forward of the model converted to bf16."""
    monkeypatch.setattr(half_matmul, "native_half_matmul", lambda dtype: False)
    calls = []
    real = half_matmul._EmulatedLinear.apply
    monkeypatch.setattr(half_matmul._EmulatedLinear, "apply", lambda *a: calls.append(a[3]) or real(*a))
    model = tiny_model("llama")
    plain = copy.deepcopy(model)
    patch_linears(model)
    ids, mask = random_batch(2, 20, left_pad=[0, 4], seed=3)  # 40 rows: >= EMULATE_MIN_ROWS
    labels = ids.masked_fill(~mask.bool(), -100)
    model.train(), plain.train()
    losses = []
    for m in (model, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss)
    assert calls and set(calls) == {torch.bfloat16} and len(calls) == len(_linears(model))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=1e-2)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        scale = q.grad.abs().max()
        assert (p.grad - q.grad).abs().max() <= 5e-2 * scale, name
    model.eval(), plain.eval()
    model.bfloat16(), plain.bfloat16()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = plain(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == torch.bfloat16
    valid = mask.bool()
    torch.testing.assert_close(got[valid].float(), want[valid].float(), rtol=5e-2, atol=5e-2)


@pytest.mark.embedded
def test_load_model_patches_the_embedded_model(embedded):
    model, _ = embedded
    linears = _linears(model)
    assert linears and all(type(m) is CPULinear for m in linears)


def test_load_model_can_keep_torch_linears(monkeypatch):
    """cpu_linears=False keeps nn.Linear (a local folder written by save_pretrained)."""
    import transformers

    from retmask.hf import loading

    model = tiny_model("llama")
    seen = {}

    def fake_from_pretrained(source, **kw):
        seen.update(kw)
        return copy.deepcopy(model)

    monkeypatch.setattr(loading, "resolve_source", lambda spec, gguf: "folder")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda source, **kw: _Tok())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(loading, "model_class_for", lambda source: transformers.AutoModelForCausalLM)
    patched, _ = loading.load_model("folder")
    kept, _ = loading.load_model("folder", cpu_linears=False)
    assert type(patched.lm_head) is CPULinear and type(kept.lm_head) is torch.nn.Linear


class _Tok:
    pad_token = "<pad>"
    eos_token = "<eos>"
