"""Reading a setting from the environment on every call, at the cost of a dict lookup.

Settings such as ``RETMASK_CPU_PATH`` are read on every attention call, so that a change of
``os.environ`` (a test's ``monkeypatch.setenv``, a notebook cell) takes effect at once. Through
``os.environ.get`` each read runs four Python functions of the ``os`` module (the mapping's ``get``,
``__getitem__``, key encoding, value decoding); in a model's decode step the layers' weights evict that
code from the caches between two attention calls, and two such reads cost about as much as the rest of
the call's argument checks (~40 us each on the AVX2 EPYC of family 25, against ~4 us for a dict lookup).

On POSIX, ``os.environ`` keeps its contents in ``os.environ._data`` (bytes names to bytes values) and
every change through ``os.environ`` (``os.environ[name] = ...``, ``del``, ``update``, ``clear``,
``monkeypatch.setenv``) updates that dict in place, so a lookup there sees exactly what
``os.environ.get`` would. Elsewhere (Windows keeps upper-cased str names) or if a future Python stores
it differently, ``setting`` reads ``os.environ.get``.
"""

from __future__ import annotations

import os

_ENCODED_NAMES: dict[str, bytes] = {}


def setting(name: str) -> str:
    """``os.environ.get(name, "").strip()``: the value of environment variable ``name``, "" if unset."""
    data = getattr(os.environ, "_data", None)
    if os.name != "posix" or type(data) is not dict:
        return os.environ.get(name, "").strip()
    key = _ENCODED_NAMES.get(name)
    if key is None:
        key = _ENCODED_NAMES[name] = os.fsencode(name)
    raw = data.get(key)
    return "" if raw is None else os.fsdecode(raw).strip()
