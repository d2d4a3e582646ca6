"""The CPU this process runs on, as Linux reports it in /proc/cpuinfo (torch-free)."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path


def _field(name: str) -> str | None:
    """The value of the first ``name : value`` line of /proc/cpuinfo, or None (no such line, no file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (falls back to platform.processor())."""
    return _field("model name") or platform.processor() or "unknown CPU"


def cpu_model_number() -> str:
    """The CPU model number within its family ("" off Linux x86): on Intel, whose cores have all been family
    6 since 2006, what tells one generation from another."""
    return _field("model") or ""


def cpu_flags() -> set[str]:
    """The feature flags of the first CPU (empty off Linux)."""
    return set((_field("flags") or "").split())


def cpu_family() -> str:
    """The CPU family number ("" off Linux x86): what tells CPUs apart when a hypervisor reports only a
    generic model name."""
    return _field("cpu family") or ""


def cpu_identity() -> dict[str, str]:
    """Model, family and a hash of the feature flags: the CPU part of what a measured decision is valid
    for (the key of the linear backend's decisions)."""
    flags = " ".join(sorted(cpu_flags())).encode()
    return {
        "cpu": cpu_model(),
        "family": cpu_family(),
        "flags_sha256": hashlib.sha256(flags).hexdigest()[:16],
    }
