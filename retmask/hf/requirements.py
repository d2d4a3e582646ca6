"""The transformers releases retmask runs on: the range retmask's package metadata declares, checked at import.

pip enforces the range when it installs retmask, but a later ``pip install transformers==X`` only warns, and
below the range retmask fails in ways that do not name the cause: transformers 5.0-5.5 call the mask
function with other arguments (a ``TypeError`` on every forward), before 5.20 its cache layers have another
abstract method (the head-sparse cache cannot be built), and before 5.24 CodeGen and GPT-J do not route
their attention through the attention interface. So importing ``retmask.hf`` raises on a release older than
the range, naming the fix, and warns on one newer than it (not tested; it may work).

The range is written once, in ``pyproject.toml`` (``[project] dependencies``), and read back from the
installed metadata, so this check and pip's cannot disagree.
"""

from __future__ import annotations

import warnings
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

PACKAGE = "transformers"


class UntestedTransformersWarning(UserWarning):
    """The installed transformers is newer than the range retmask was tested with."""


def declared_range(package: str = PACKAGE) -> SpecifierSet | None:
    """The version range retmask's installed metadata declares for ``package``; None when retmask's
    metadata is not installed (the source tree on ``sys.path`` without ``pip install``) or names none."""
    try:
        requires = metadata.requires("retmask") or []
    except metadata.PackageNotFoundError:
        return None
    for line in requires:
        requirement = Requirement(line)
        if requirement.name == package and requirement.marker is None:
            return requirement.specifier
    return None


def check_transformers(found: str, allowed: SpecifierSet | None) -> None:
    """Raise ``ImportError`` when ``found`` (a transformers version) is older than ``allowed`` permits,
    warn when it is newer; nothing when it is inside, or when there is no range to check against."""
    if allowed is None or allowed.contains(found, prereleases=True):
        return
    version = Version(found)
    lower_bounds = [spec for spec in allowed if spec.operator in (">=", ">", "==", "~=", "===")]
    # Lower bounds first (">=5.24,<6"); packaging's own str() sorts them the other way round.
    written = ",".join(map(str, lower_bounds + [spec for spec in allowed if spec not in lower_bounds]))
    fix = f'pip install "{PACKAGE}{written}"'
    if any(not spec.contains(version, prereleases=True) for spec in lower_bounds):
        raise ImportError(
            f"retmask needs {PACKAGE}{written}, found {PACKAGE} {found}: older releases call the attention "
            f"mask function differently and route fewer models through the attention interface. Fix: {fix}"
        )
    warnings.warn(
        f"retmask was tested with {PACKAGE}{written}, found {PACKAGE} {found}: it may work; if a model "
        f"fails, {fix}",
        UntestedTransformersWarning,
        stacklevel=3,
    )
