"""Project only the labelled positions through TRL's fused LM head on a CPU.

TRL 1.16's DPO scores completions with a fused LM head (``trl.trainer.utils.add_fused_lm_head``): the last
hidden states go through the LM head in tiles that are folded into log-softmax statistics, so the
``[tokens, vocab]`` logits never exist. On CUDA and XPU it projects only the positions whose label is not
-100, i.e. the completion tokens. On every other device it projects *every* position, prompt and padding
included, and zeroes the unused ones afterwards: fixed tile shapes spare devices that recompile on a new
shape (Neuron) a recompilation per batch. A CPU recompiles nothing, and in a DPO batch the completions
are the minority of the positions: the prompt comes before each of them and chosen / rejected are padded
to one length. For SmolLM2-135M (49K vocabulary) on a 2-core CPU the head was 42% of a bf16 DPO step and
22% once only the completion positions were projected.

:func:`labelled_positions_only` makes the head take its compact path on a CPU inside a ``with`` block
(``retmask train`` wraps the training loop in it). The scored positions' log-probabilities are the same
computation on fewer rows of the same GEMM; the skipped ones were masked to zero either way.

:func:`cpu_lm_head` (also entered by ``retmask train``) runs the head itself on CPU tensors with
``retmask.cpu_speedups.logprob.CPUChunkedLogProb`` instead of TRL's kernel, whose torch fallback for
devices without Triton spends most of its time outside the GEMMs (see that module). With the CPU
speed-ups off (``RETMASK_CPU_SPEEDUPS=0``) TRL's stays.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

# "labelled": the compact path on a CPU (default); "all": TRL's own choice for the device.
LM_HEAD_POSITIONS = ("labelled", "all")
LM_HEAD_IMPLS = ("retmask", "trl")  # who computes the head's log-probabilities on CPU tensors


def check_positions(positions: str) -> None:
    """Raise ValueError unless ``positions`` is one of :data:`LM_HEAD_POSITIONS`."""
    if positions not in LM_HEAD_POSITIONS:
        raise ValueError(f"lm head positions must be one of {LM_HEAD_POSITIONS}, got {positions!r}")


def _trl_switch() -> tuple[Any, Callable[[Any], bool]] | None:
    """(TRL's utils module, its device predicate that selects the compact path), or None when this TRL has
    no such predicate (not installed, or a version that decides otherwise): then nothing is changed."""
    try:
        import trl.trainer.utils as trl_utils
    except ImportError:
        return None
    predicate = getattr(trl_utils, "_use_triton", None)
    if not callable(predicate) or not hasattr(trl_utils, "add_fused_lm_head"):
        return None
    return trl_utils, predicate


@contextlib.contextmanager
def labelled_positions_only(positions: str = "labelled") -> Iterator[bool]:
    """Inside the block, TRL's fused LM head projects only labelled positions on CPU tensors as well.

    ``positions``: ``"labelled"`` (the compact path) or ``"all"`` (TRL's behaviour, nothing changed).
    Yields whether the switch is in effect. TRL reads the predicate at every call, so the change applies to
    models patched before the block too, and it is undone on exit, exceptions included.
    """
    check_positions(positions)
    switch = _trl_switch() if positions == "labelled" else None
    if switch is None:
        yield False
        return
    trl_utils, original = switch

    def compact_on_cpu(device: Any) -> bool:
        return getattr(device, "type", None) == "cpu" or original(device)

    trl_utils._use_triton = compact_on_cpu
    try:
        yield True
    finally:
        trl_utils._use_triton = original


# The arguments of TRL 1.16's ChunkedLogProbFunction.forward (after ctx), which CPUChunkedLogProb takes.
HEAD_ARGUMENTS = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
                  "logit_scale", "outputs")  # fmt: skip


def _same_contract(function: Any) -> bool:
    """Whether TRL's head function takes the arguments CPUChunkedLogProb does (another TRL version may
    not: then TRL's own head is kept)."""
    forward = getattr(function, "forward", None)
    if forward is None or not hasattr(function, "apply"):
        return False
    try:
        names = tuple(inspect.signature(forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return names == HEAD_ARGUMENTS


def lm_head_impl() -> str:
    """``retmask`` while the CPU speed-ups are on (the default), ``trl`` with ``RETMASK_CPU_SPEEDUPS=0``;
    ValueError naming the variable for a bad value."""
    from retmask import cpu_speedups

    return "retmask" if cpu_speedups.enabled() else "trl"


@contextlib.contextmanager
def cpu_lm_head(impl: str | None = None) -> Iterator[str]:
    """Inside the block, TRL's fused LM head computes on CPU tensors with retmask's
    ``CPUChunkedLogProb`` (same arguments, outputs and gradients as TRL's kernel); other devices keep
    TRL's. ``impl``: ``"retmask"`` or ``"trl"`` (nothing changed); default ``lm_head_impl()``.
    Yields the implementation in effect: ``"trl"`` also where this TRL has no such kernel to replace or
    one with other arguments.
    Undone on exit, exceptions included."""
    impl = lm_head_impl() if impl is None else impl
    if impl not in LM_HEAD_IMPLS:
        raise ValueError(f"lm head implementation must be one of {LM_HEAD_IMPLS}, got {impl!r}")
    switch = _trl_switch()
    original = getattr(switch[0], "_ChunkedLogProbFunction", None) if switch is not None else None
    if impl == "trl" or not _same_contract(original):
        yield "trl"
        return
    trl_utils = switch[0]
    from retmask.cpu_speedups.logprob import CPUChunkedLogProb

    class OnCPU:
        """TRL's ``_ChunkedLogProbFunction`` seen by its fused forward: retmask's on CPU tensors."""

        @staticmethod
        def apply(hidden: Any, *args: Any) -> Any:
            on_cpu = getattr(hidden, "device", None) is not None and hidden.device.type == "cpu"
            return (CPUChunkedLogProb if on_cpu else original).apply(hidden, *args)

    trl_utils._ChunkedLogProbFunction = OnCPU
    try:
        yield "retmask"
    finally:
        trl_utils._ChunkedLogProbFunction = original
