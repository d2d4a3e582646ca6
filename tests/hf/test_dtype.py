"""``--dtype auto``: bf16 exactly where the device computes it natively, fp32 elsewhere."""

from __future__ import annotations

import warnings

import pytest
import torch

from retmask.cpu_speedups import half_matmul
from retmask.errors import UsageError
from retmask.hf import loading
from tests.kernels.test_cpu_builds import cpu_flags


def _fake_cpu(monkeypatch, *, amx: bool, avx512_bf16: bool) -> None:
    flags = (
        {"avx2", "fma"}
        | ({"amx_tile", "amx_bf16"} if amx else set())
        | ({"avx512_bf16"} if avx512_bf16 else set())
    )
    monkeypatch.setattr(half_matmul, "_cpu_flags", lambda: frozenset(flags))


@pytest.mark.parametrize(
    "amx,avx512_bf16,expected",
    [
        (False, False, "float32"),
        (True, False, "bfloat16"),
        (False, True, "bfloat16"),
        (True, True, "bfloat16"),
    ],
)
def test_auto_follows_native_bf16_on_cpu(monkeypatch, amx, avx512_bf16, expected):
    _fake_cpu(monkeypatch, amx=amx, avx512_bf16=avx512_bf16)
    assert loading.resolve_dtype_name("auto", "cpu") == expected
    assert loading.parse_dtype("auto", "cpu") == loading.DTYPES[expected]


def test_explicit_names_are_kept(monkeypatch):
    _fake_cpu(monkeypatch, amx=True, avx512_bf16=True)
    for name in loading.DTYPES:
        assert loading.resolve_dtype_name(name, "cpu") == name
    assert loading.parse_dtype("float32") is torch.float32


def test_explicit_bf16_warns_only_where_it_is_emulated(monkeypatch):
    _fake_cpu(monkeypatch, amx=False, avx512_bf16=False)
    with pytest.warns(loading.EmulatedBf16Warning, match=r"without native bf16.*--dtype auto picks float32"):
        assert loading.resolve_dtype_name("bfloat16", "cpu") == "bfloat16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        assert loading.resolve_dtype_name("auto", "cpu") == "float32"
        assert loading.resolve_dtype_name("float32", "cpu") == "float32"
        loading.resolve_dtype_name("bfloat16", "cuda")  # a GPU's bf16 is its own question
        _fake_cpu(monkeypatch, amx=True, avx512_bf16=False)
        assert loading.resolve_dtype_name("bfloat16", "cpu") == "bfloat16"


def test_this_machine_matches_its_cpu_flags():
    """No monkeypatching: auto is bf16 exactly when /proc/cpuinfo lists AMX-BF16 or AVX512-BF16."""
    flags = cpu_flags()
    native = bool({"amx_bf16", "avx512_bf16"} & flags)
    assert loading.native_bf16("cpu") == native
    assert loading.resolve_dtype_name("auto") == ("bfloat16" if native else "float32")


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match=r"--dtype must be one of \['auto', 'float32'.*got 'fp8'"):
        loading.parse_dtype("fp8")


def test_cuda_without_a_gpu_is_not_bf16():
    if torch.cuda.is_available():  # a GPU machine: auto follows the GPU's own bf16 support
        assert loading.native_bf16("cuda") == torch.cuda.is_bf16_supported()
    else:
        assert loading.native_bf16("cuda") is False


def test_bf16_autocast_forward_and_backward_follow_sdpa():
    """Under CPU bf16 autocast the rotary embedding leaves q, k in float32 and v in bf16; retmask attention
    casts them to the autocast dtype as SDPA does, so logits and gradients follow SDPA's."""
    from retmask.detect.core import attn_implementation
    from tests.tiny import tiny_llama

    model = tiny_llama()
    ids = torch.randint(3, 16, (2, 40), generator=torch.Generator().manual_seed(0))
    got = {}
    for impl in ("retmask", "sdpa"):
        model.zero_grad(set_to_none=True)
        with attn_implementation(model, impl), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        assert logits.dtype == torch.bfloat16
        logits.float().logsumexp(-1).mean().backward()
        got[impl] = (logits.float(), model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(got["retmask"][0], got["sdpa"][0], rtol=0.05, atol=0.05)
    grad, want = got["retmask"][1], got["sdpa"][1]
    assert (
        want.norm() > 0 and (grad - want).norm() < 0.03 * want.norm()
    )  # bf16 rounding, not a wrong gradient


def test_load_model_checks_its_dtype_before_loading(tmp_path):
    """A dtype name is one of the commands' (``"auto"`` as they mean it); anything else is refused before
    any file is read (``"bf16"`` used to fail inside transformers after the tokenizer had loaded)."""
    from retmask.hf.loading import load_model

    missing = str(tmp_path / "no-model")
    with pytest.raises(ValueError, match=r"--dtype must be one of \['auto', 'float32'.*got 'bf16'"):
        load_model(missing, dtype="bf16")
    with pytest.raises(ValueError, match=r"dtype must be a floating torch.dtype .*got torch.int64"):
        load_model(missing, dtype=torch.int64)
    with pytest.raises(UsageError, match="does not exist"):  # a valid name gets as far as the path
        load_model(missing, dtype="auto")
