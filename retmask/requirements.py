"""The releases of its dependencies retmask runs on: the ranges its package metadata declares, checked where
they matter and shown by ``retmask env``.

pip enforces the ranges when it installs retmask, but a later ``pip install transformers==X`` only warns, and
outside them retmask fails in ways that do not name the cause: transformers 5.0-5.5 call the mask function
with other arguments (a ``TypeError`` on every forward), before 5.20 its cache layers have another abstract
method (the head-sparse cache cannot be built), and before 5.24 CodeGen and GPT-J do not route their
attention through the attention interface; transformers reads a GGUF file only with accelerate >= 1.1, and
its error then reads like a damaged file's. So importing ``retmask.hf`` checks transformers and converting
a GGUF file checks accelerate and gguf: a release older than the range raises, naming the fix; a newer one
warns (not tested; it may work).

The ranges are written once, in ``pyproject.toml`` (``[project] dependencies``), and read back from the
installed metadata, so these checks and pip's cannot disagree. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import warnings
from importlib import metadata
from typing import Literal

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from retmask.errors import UsageError

# What goes wrong below each checked package's range, for the error message.
WHY = {
    "transformers": "older releases call the attention mask function differently and route fewer models "
    "through the attention interface",
    "accelerate": "transformers reads GGUF files only with accelerate 1.1 or newer",
    "gguf": "transformers reads GGUF files with it",
    "trl": "retmask's DPO and SFT training run on TRL's trainers",
    "datasets": "TRL's trainers take their data as a datasets Dataset",
}
# The dependencies ``retmask env`` reports against their ranges: (package, the extra that brings it or None).
REPORTED = (
    ("torch", None), ("transformers", None), ("accelerate", None), ("gguf", None), ("trl", "train"),
    ("datasets", "train"), ("triton", "triton"),
)  # fmt: skip

Status = Literal["ok", "missing", "older", "newer", "no range"]


class UnsupportedReleaseError(ImportError, UsageError):
    """A dependency missing or older than retmask's range; a ``UsageError``, so commands print it in one line."""


class UntestedReleaseWarning(UserWarning):
    """An installed dependency is newer than the range retmask was tested with."""


def declared_range(package: str, extra: str | None = None) -> SpecifierSet | None:
    """The version range retmask's installed metadata declares for ``package`` (among the dependencies of
    the optional ``extra``, e.g. "train", when given); None when retmask's metadata is not installed (the
    source tree on ``sys.path`` without ``pip install``) or names none."""
    try:
        requires = metadata.requires("retmask") or []
    except metadata.PackageNotFoundError:
        return None
    for line in requires:
        requirement = Requirement(line)
        if requirement.name != package:
            continue
        if requirement.marker is None if extra is None else requirement.marker.evaluate({"extra": extra}):
            return requirement.specifier
    return None


def installed_version(package: str) -> str | None:
    """The installed release of ``package``, or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _lower_bounds(allowed: SpecifierSet) -> list:
    return [spec for spec in allowed if spec.operator in (">=", ">", "==", "~=", "===")]


def written(allowed: SpecifierSet) -> str:
    """``allowed`` with its lower bounds first (">=5.24,<6"); packaging's own str() sorts them the other way."""
    lower = _lower_bounds(allowed)
    return ",".join(map(str, lower + [spec for spec in allowed if spec not in lower]))


def status(found: str | None, allowed: SpecifierSet | None) -> Status:
    """Where release ``found`` (None: not installed) stands against ``allowed``."""
    if allowed is None:
        return "no range"
    if found is None:
        return "missing"
    if allowed.contains(found, prereleases=True):
        return "ok"
    version = Version(found)
    return (
        "older" if any(not s.contains(version, prereleases=True) for s in _lower_bounds(allowed)) else "newer"
    )


def check_release(
    package: str, found: str | None, allowed: SpecifierSet | None, extra: str | None = None
) -> None:
    """Raise ``UnsupportedReleaseError`` (an ``ImportError``) when ``package`` is missing (``found`` None)
    or older than ``allowed`` permits, warn when it is newer; nothing when it is inside, or when there is no
    range to check against. ``extra``: the optional dependency group that brings it, named in the fix."""
    where = status(found, allowed)
    if where in ("ok", "no range"):
        return
    fix = f'pip install "{package}{written(allowed)}"'
    if extra is not None:
        fix += f' (it comes with retmask\'s "{extra}" extra)'
    why = WHY.get(package, "")
    if where == "missing":
        raise UnsupportedReleaseError(
            f"retmask needs {package}{written(allowed)}, which is not installed ({why}). Fix: {fix}"
        )
    if where == "older":
        raise UnsupportedReleaseError(
            f"retmask needs {package}{written(allowed)}, found {package} {found}: {why}. Fix: {fix}"
        )
    warnings.warn(
        f"retmask was tested with {package}{written(allowed)}, found {package} {found}: it may work; "
        f"if it fails, {fix}",
        UntestedReleaseWarning,
        stacklevel=3,
    )


def check_installed(package: str, extra: str | None = None) -> None:
    """``check_release`` for the installed ``package`` against the range retmask declares for it (in the
    optional ``extra``, when given)."""
    check_release(package, installed_version(package), declared_range(package, extra), extra)


def report(packages: tuple[tuple[str, str | None], ...] = REPORTED) -> dict[str, dict[str, str | None]]:
    """For ``retmask env``: each package's installed release, retmask's range for it and where it stands
    (an optional one that is not installed is "missing" too: the commands that need it say so)."""
    out: dict[str, dict[str, str | None]] = {}
    for package, extra in packages:
        found, allowed = installed_version(package), declared_range(package, extra)
        out[package] = {
            "installed": found,
            "range": written(allowed) if allowed is not None else None,
            "status": status(found, allowed),
        }
    return out
