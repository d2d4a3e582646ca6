"""Whether a call runs in plain eager execution, asked through torch's public API only.

retmask takes a shortcut on some calls when nothing could tell the difference: the attention operator's
body called without the dispatcher round trip (``kernels.ops.eager_direct``), the C++ backward that reads
tensor data (``kernels.ops.recompute_grads``), oneDNN's or fp32-emulated linears in place of
``aten::linear`` (``cpu_speedups``). Each must step aside when something should see the operator it
stands for, or when its tensors are not plain data:

* ``torch.compile`` / ``torch.export`` tracing: ``torch.compiler.is_compiling()``;
* a torch function mode (``torch.device(...)`` as a context, ``TorchFunctionMode``) or a tensor with its own
  ``__torch_function__``: ``torch.overrides.has_torch_function``;
* a tensor wrapped by a functorch transform (``torch.func.vmap``, ``grad``, ``jacrev``...):
  ``torch.func.debug_unwrap`` returns another tensor for it;
* forward-mode AD: a tensor that carries a tangent (``torch.autograd.forward_ad.unpack_dual``).

A dispatch mode (``TorchDispatchMode``, e.g. ``FlopCounterMode``) has no public query, so it is not seen:
under one, a shortcut runs and the mode sees the operators the shortcut calls (a FLOP counter counts
oneDNN's linear through the formula ``cpu_speedups.linear`` registers for it). Tensor subclasses that
only override ``__torch_dispatch__`` (FakeTensor, functional tensors) are caught by the callers' own
``type(t) is torch.Tensor`` checks.
"""

from __future__ import annotations

import torch
from torch.autograd.forward_ad import unpack_dual
from torch.func import debug_unwrap
from torch.overrides import has_torch_function


def traced(*tensors: torch.Tensor | None) -> bool:
    """True if a call on ``tensors`` (None entries ignored) is being traced by ``torch.compile`` or seen by
    a torch function mode or a tensor's own ``__torch_function__``."""
    return torch.compiler.is_compiling() or has_torch_function(tensors)  # None has no __torch_function__


def transformed(*tensors: torch.Tensor | None) -> bool:
    """True if one of ``tensors`` (None entries ignored) is wrapped by a functorch transform or carries a
    forward-mode tangent: its values are not all the call has to compute."""
    for t in tensors:  # a loop, not any() over a generator: this runs on every decode call of every layer
        if t is None:
            continue
        if debug_unwrap(t, recurse=False) is not t:
            return True
        if unpack_dual(t).tangent is not None:
            return True
    return False


def plain_eager(*tensors: torch.Tensor | None) -> bool:
    """True if a call on ``tensors`` (None entries ignored) is plain eager execution: neither ``traced``
    nor ``transformed``."""
    return not traced(*tensors) and not transformed(*tensors)
