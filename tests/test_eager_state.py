"""retmask.eager_state.plain_eager: each state it must see (compile tracing, a function mode, a tensor
with its own __torch_function__, functorch transforms, forward-mode tangents) and the plain calls it must
let through (None entries, parameters, bool masks, tensors outside a transform's reach)."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from retmask.eager_state import plain_eager


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, generator=gen), torch.randn(4, 3, generator=gen)


def test_plain_calls_pass():
    x, w = _tensors()
    assert plain_eager(x, w, None)
    assert plain_eager(x, torch.nn.Parameter(w), torch.ones(2, dtype=torch.bool))
    assert plain_eager()
    with torch.no_grad():
        assert plain_eager(x.requires_grad_(True))


def test_torch_function_mode_and_subclass():
    x, w = _tensors()
    with torch.device("cpu"):
        assert not plain_eager(x, w)

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    assert not plain_eager(x, w.as_subclass(Logged))


@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp"])
def test_functorch_transforms(transform):
    x, w = _tensors()
    seen = []

    def f(t):
        seen.append((plain_eager(t), plain_eager(w)))  # w is closed over: not the transform's
        return (t * 2).sum()

    if transform == "vmap":
        torch.func.vmap(f)(x)
    elif transform == "grad":
        torch.func.grad(f)(x)
    else:
        torch.func.jvp(f, (x,), (torch.ones_like(x),))
    assert seen == [(False, True)]


def test_forward_mode_tangent():
    x, w = _tensors()
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        assert not plain_eager(w, dual)
        assert plain_eager(x, w)  # a level alone changes nothing for tensors without a tangent


def test_compile_tracing():
    seen = []

    def f(t):
        seen.append(plain_eager(t))
        return t + 1

    x, _ = _tensors()
    torch.compile(f, backend="eager", fullgraph=False)(x)
    assert seen == [False]
