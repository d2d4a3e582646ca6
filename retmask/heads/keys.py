"""The vocabulary of attention heads: a head is ``(layer, query_head)``, written ``"layer-head"`` in files.

Every module that names heads uses these definitions; score files (``{"15-30": [...]}``), heads files
(``{"heads": [[15, 30], ...]}``), command-line lists (``"15-30,16-1"``) and Python lists of pairs all go
through :func:`parse_head_key` / :func:`parse_head_pair`.
"""

from __future__ import annotations

import numbers
from typing import Any

RETRIEVAL_TAU = 0.1
"""The published threshold: a head whose mean retrieval score is >= 0.1 is a retrieval head."""

Head = tuple[int, int]
"""``(layer, query_head)``, both 0-based. Scores and masks are per *query* head (GQA shares KV heads)."""


class SelectionError(ValueError):
    """A scores file, heads file or head selection that cannot be honoured (the message says why)."""


def head_key(layer: int, head: int) -> str:
    """``"layer-head"``: the key format of published ``head_score/*.json`` files."""
    return f"{layer}-{head}"


def parse_head_key(key: str, *, source: str = "scores") -> Head:
    """Parse ``"<layer>-<head>"`` into ``(layer, head)``; anything else is an error naming the key."""
    parts = key.split("-") if isinstance(key, str) else []
    # ASCII digits only: str.isdigit also accepts '１', '٣' and '²', which int() reads differently or not at all
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
        raise SelectionError(
            f"{source}: key {key!r} is not '<layer>-<head>' with two non-negative integers (e.g. '15-30')"
        )
    return int(parts[0]), int(parts[1])


def _is_index(x: Any) -> bool:
    # bool is an int subclass: (0, True) would silently index "every head" in a tensor mask. NumPy
    # integers (np.argwhere rows) register as numbers.Integral; NumPy bools do not.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def parse_head_pair(item: Any, where: str) -> Head:
    """``[layer, head]`` / ``(layer, head)`` of non-negative ints, or a ``"layer-head"`` string.

    0-d integer tensors and NumPy integers are accepted, and a pair may be a 1-D integer tensor or array
    of two (the rows of ``mask.nonzero()`` / ``np.argwhere(mask)``); bools and floats are not.
    """
    if isinstance(item, str):
        return parse_head_key(item, source=where)
    if getattr(item, "ndim", None) == 1 and hasattr(item, "tolist"):  # a tensor / array row of a pair list
        item = item.tolist()
    if isinstance(item, (list, tuple)) and len(item) == 2:
        pair = []
        for x in item:
            if (
                hasattr(x, "dim")
                and x.dim() == 0
                and not x.dtype.is_floating_point
                and not x.dtype.is_complex
            ):
                x = x.item()
            pair.append(x)
        if all(_is_index(x) for x in pair):
            negative = [f"{what} {x}" for what, x in zip(("layer", "head"), pair, strict=True) if x < 0]
            if not negative:
                return int(pair[0]), int(pair[1])
            raise SelectionError(
                f"{where} is {item!r}: {' and '.join(negative)} is negative; layers and heads count from 0"
            )
    raise SelectionError(
        f"{where} is {item!r}; each head must be a [layer, head] pair of integers >= 0 or a 'layer-head' string"
    )
