"""The Triton launch path (``retmask.kernels.triton.launch``): Triton's JIT entry, or the cache of compiled
kernels per specialisation.

On the CPU the cache's logic runs against a stand-in kernel (Triton cannot compile without a GPU), and the
real call sites are checked for the one thing the cache assumes of them (runtime parameters by position,
constexprs by name). With ``RETMASK_TEST_DEVICE=cuda`` the last test runs the real kernels through the
cache, each launch checked against the kernel Triton itself picks, and compares them with the JIT entry.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from triton.runtime.errors import OutOfResources

from retmask.kernels import paths
from retmask.kernels.triton import backend as triton_backend
from retmask.kernels.triton import bwd as triton_bwd
from retmask.kernels.triton import common as triton_common
from retmask.kernels.triton import launch as triton_launch
from retmask.kernels.triton.launch import launch_kernel, specialisation

from ..device import TEST_DEVICE
from .helpers import left_padding_mask, make_qkv


def test_specialisation_holds_what_triton_specialises_on():
    """Alignment and dtype of tensors, and 1 / divisible by 16 / width class of ints, change the key;
    values that share those facts do not; a bool is not an int."""
    base = torch.randn(64)
    aligned, misaligned = base[:32], base[1:33]  # 4 bytes off a 16-byte boundary
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 != 0
    key = specialisation((aligned, 32, 7, 0.5, None, True))
    assert key == specialisation((base[16:48], 48, 9, 2.0, None, False))  # same facts, other values
    changed = [
        (misaligned, 32, 7, 0.5, None, True),  # misaligned address
        (aligned.half(), 32, 7, 0.5, None, True),  # dtype
        (aligned, 33, 7, 0.5, None, True),  # no longer divisible by 16
        (aligned, 32, 1, 0.5, None, True),  # equal to 1
        (aligned, 32, 2**31, 0.5, None, True),  # int64
        (aligned, 32, 2**63, 0.5, None, True),  # uint64
        (aligned, 32, 7, 0.5, None, 1),  # an int where a bool was
        (aligned, 32, 7, 1, None, True),  # an int where a float was
    ]
    for args in changed:
        assert specialisation(args) != key, args


@dataclass
class _Param:
    name: str
    is_constexpr: bool
    default: Any = inspect.Parameter.empty

    @property
    def has_default(self) -> bool:
        return self.default is not inspect.Parameter.empty


class _Compiled:
    """Stands in for a CompiledKernel: ``compiled[grid](*args)`` records the launch."""

    def __init__(self, launches: list, refuse: int = 0):
        self.launches, self.refuse = launches, refuse

    def __getitem__(self, grid):
        def run(*args):
            if self.refuse:
                self.refuse -= 1
                raise OutOfResources(300_000, 232_448, "shared memory")
            self.launches.append((self, (grid[0], grid[1], grid[2]), args))  # as Triton's launcher reads it

        return run


@dataclass
class _Kernel:
    """Stands in for a JITFunction: ``warmup`` 'compiles' one kernel per distinct specialisation, as
    Triton does; ``[grid]`` is the JIT entry."""

    params: list[_Param]
    launches: list = field(default_factory=list)
    compiled: dict = field(default_factory=dict)
    warmups: int = 0
    refuse: int = 0

    class fn:  # noqa: N801 (mirrors JITFunction.fn)
        __name__ = "_stand_in_kernel"

    def warmup(self, *args, grid, **kwargs):
        self.warmups += 1
        key = (specialisation(args), tuple(sorted(kwargs.items())))
        if key not in self.compiled:
            self.compiled[key] = _Compiled(self.launches, self.refuse)
        return self.compiled[key]

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append(("jit", grid, args, kwargs))

        return run


def _stand_in() -> _Kernel:
    params = [_Param("x", False), _Param("n", False), _Param("scale", False)]
    params += [_Param("BLOCK", True), _Param("FLAG", True), _Param("MODE", True, default="ieee")]
    return _Kernel(params)


@pytest.fixture
def cached(monkeypatch):
    """The cache on, for stand-in kernels, on a pretend device 0."""
    monkeypatch.setattr(triton_launch, "cached_triton_launch", lambda kernel: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_LAUNCHERS", {})


def test_cached_launch_compiles_once_per_specialisation(cached):
    """The first call of a specialisation asks Triton (warmup); later ones launch the kept kernel with
    every parameter in order, constexprs and defaults included; a new specialisation asks again."""
    kernel = _stand_in()
    x = torch.randn(64)
    launch_kernel(kernel, (2, 3), x[:32], 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    launch_kernel(kernel, (5, 1), x[16:48], 48, 0.25, BLOCK=16, FLAG=True, num_warps=4)
    assert kernel.warmups == 1
    (c1, g1, a1), (c2, g2, a2) = kernel.launches
    assert c1 is c2 and (g1, g2) == ((2, 3, 1), (5, 1, 1))
    assert a2[1:] == (48, 0.25, 16, True, "ieee") and a2[0].data_ptr() == x[16:48].data_ptr()
    launch_kernel(kernel, (1,), x[1:33], 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)  # misaligned
    launch_kernel(kernel, (1,), x[:32], 32, 0.5, BLOCK=32, FLAG=True, num_warps=4)  # other constexpr
    launch_kernel(kernel, (1,), x[:32], 32, 0.5, BLOCK=16, FLAG=True, num_warps=8)  # other option
    assert kernel.warmups == 4 and len({id(c) for c, _, _ in kernel.launches}) == 4


def test_check_launches_catches_a_kernel_triton_would_not_pick(cached, monkeypatch):
    """With CHECK_LAUNCHES a cached launch whose kernel is not Triton's choice for the call fails."""
    monkeypatch.setattr(triton_launch, "CHECK_LAUNCHES", True)
    kernel = _stand_in()
    x = torch.randn(32)
    launch_kernel(kernel, (1,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    launch_kernel(kernel, (1,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)  # agrees: passes
    kernel.compiled.clear()  # Triton would now hand out another kernel for the same call
    with pytest.raises(AssertionError, match="not the kernel Triton picks"):
        launch_kernel(kernel, (1,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)


def test_a_refused_launch_is_not_kept(cached):
    """A kernel the GPU refuses (OutOfResources) is not cached: the next call asks Triton again."""
    kernel = _stand_in()
    kernel.refuse = 1
    x = torch.randn(32)
    with pytest.raises(OutOfResources):
        launch_kernel(kernel, (1,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    assert triton_launch._LAUNCHERS == {}
    launch_kernel(kernel, (1,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    assert kernel.warmups == 2 and len(kernel.launches) == 1


def test_constexprs_passed_by_position_are_refused(cached):
    kernel = _stand_in()
    with pytest.raises(TypeError, match="by name"):
        launch_kernel(kernel, (1,), torch.randn(32), 32, 0.5, 16, FLAG=True, num_warps=4)


def test_without_the_rule_a_launch_is_the_jit_entry(monkeypatch):
    """The default: ``kernel[grid](*args, **constexprs, num_warps, num_stages)``, nothing cached."""
    monkeypatch.setattr(triton_launch, "_LAUNCHERS", {})
    kernel = _stand_in()
    x = torch.randn(32)
    launch_kernel(kernel, (2,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, num_stages=2)
    launch_kernel(kernel, (2,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=8)
    assert kernel.launches == [
        ("jit", (2,), (x, 32, 0.5), dict(BLOCK=16, FLAG=True, num_warps=4, num_stages=2)),
        ("jit", (2,), (x, 32, 0.5), dict(BLOCK=16, FLAG=True, num_warps=8)),
    ]
    assert kernel.warmups == 0 and triton_launch._LAUNCHERS == {}
    assert not paths.cached_triton_launch(kernel)  # the default: off


def _never_compiled(x):
    pass


def test_the_rule_caches_only_jit_functions_and_only_when_on(monkeypatch):
    """``paths.cached_triton_launch``: off by default; on, only for Triton's JIT kernels (the
    interpreter's kernels and stand-ins keep ``kernel[grid]``)."""
    from triton.runtime.jit import JITFunction

    jit = JITFunction(_never_compiled)
    assert not paths.cached_triton_launch(jit)
    monkeypatch.setattr(paths, "CACHED_TRITON_LAUNCH", True)
    assert paths.cached_triton_launch(jit)
    assert not paths.cached_triton_launch(_stand_in())
    # our kernels: the interpreter's on a CPU-only machine, Triton's JIT kernels on a GPU
    assert paths.cached_triton_launch(triton_bwd._bwd_dq_kernel) == (not triton_common.interpreting())


def test_every_call_site_passes_runtime_arguments_by_position_and_constexprs_by_name(monkeypatch):
    """What the cache assumes of a launch: the kernel's runtime parameters come positionally, in order,
    and exactly its constexpr parameters by name. Checked for every kernel on the standard launches
    (forward with and without argmax, decode, a 33-row verification pass, backward; with window,
    soft-capping and sinks), recorded without running."""
    from retmask.kernels.triton.aot import KERNELS, record_standard_launches

    kinds = {}
    for module_name, names in KERNELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            params = inspect.signature(getattr(module, name).fn).parameters.values()
            const = [p.name for p in params if "constexpr" in str(p.annotation)]
            kinds[name] = ([p.name for p in params if p.name not in const], set(const))
    seen = []
    original = triton_launch.launch_kernel

    def checked(kernel, grid, *args, num_warps, num_stages=None, **constexprs):
        runtime, const = kinds[kernel.name]
        assert len(args) == len(runtime), kernel.name
        assert set(constexprs) == const, (kernel.name, set(constexprs) ^ const)
        seen.append(kernel.name)
        return original(kernel, grid, *args, num_warps=num_warps, num_stages=num_stages, **constexprs)

    for module_name in KERNELS:
        monkeypatch.setattr(importlib.import_module(module_name), "launch_kernel", checked)
    for features in (False, True):
        record_standard_launches(torch.float16, 64, features)
    assert set(seen) == set(kinds)


@pytest.mark.skipif(
    TEST_DEVICE.type != "cuda", reason="compiled launches need a GPU (RETMASK_TEST_DEVICE=cuda)"
)
def test_cached_launches_are_the_jit_entrys_kernels_on_gpu(monkeypatch):
    """On the GPU, every kernel through the cache (each launch checked against Triton's own choice)
    gives bit for bit the JIT entry's outputs: prefill with argmax, decode, a 9-row verification pass and
    the backward, with padding, skipped heads, a misaligned query view and odd strides."""
    monkeypatch.setattr(triton_common, "POISON_OUTPUTS", True)
    dev = TEST_DEVICE
    B, Hq, Hkv, N, D = 2, 8, 2, 333, 64
    q, k, v = (t.to(dev) for t in make_qkv(B, Hq, Hkv, N, N, D, dtype=torch.bfloat16, seed=7))
    misaligned_q = torch.empty(q.numel() + 1, dtype=q.dtype, device=dev)[1:].view_as(q).copy_(q)  # 2 B off
    odd_k = torch.empty(B, Hkv, N, D + 1, dtype=k.dtype, device=dev)[..., :D].copy_(k)  # row stride 65
    assert misaligned_q.data_ptr() % 16 != 0
    pad = left_padding_mask(B, N, [0, 5]).to(dev)
    skip = torch.zeros(B, Hq, dtype=torch.bool, device=dev)
    skip[1, 3] = True
    kw = dict(causal=True, sm_scale=0.125, key_padding_mask=pad, skip_heads=skip)

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        outs = []
        for qs, ks in ((q, k), (q[:, :, -1:], k), (misaligned_q[:, :, -9:], k), (q[:, :, -9:], odd_k)):
            out, argmax, lse = triton_backend.forward(
                qs, ks, v, argmax_rows=min(qs.shape[2], 4), return_lse=True, **kw
            )
            outs += [out, argmax, lse]
        out, _, lse = outs[:3]
        grads = triton_bwd.attention_backward(torch.randn_like(out), q, k, v, out, lse, **kw)
        return outs + [g for g in grads if g is not None]

    jit = run()
    monkeypatch.setattr(paths, "CACHED_TRITON_LAUNCH", True)
    monkeypatch.setattr(triton_launch, "CHECK_LAUNCHES", True)
    monkeypatch.setattr(triton_launch, "_LAUNCHERS", {})
    first = run()
    assert len(triton_launch._LAUNCHERS) >= 6  # every kernel went through the cache
    again = run()  # every launch now from the cache, still checked
    for a, b, c in zip(jit, first, again, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)
