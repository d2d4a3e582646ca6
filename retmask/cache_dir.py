"""The folder where retmask keeps what it can rebuild: converted models, measured kernel choices."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$RETMASK_CACHE``, else ``$XDG_CACHE_HOME/retmask``, else ``~/.cache/retmask``. Deleting it is
    safe: converted models are converted again on the next load, kernel choices measured again."""
    if os.environ.get("RETMASK_CACHE"):
        return Path(os.environ["RETMASK_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "retmask"
