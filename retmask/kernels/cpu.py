"""CPU backend of ``retmask.kernels.attention``.

Provisional: dispatches to the blocked-torch path (``cpu_blocked``). The fused C++ kernel from csrc/
(``retmask._C``) plugs in here; whichever is measured faster becomes the default.
"""

from __future__ import annotations

from .cpu_blocked import forward

__all__ = ["forward"]
