"""Dependency ranges: declared once (pyproject.toml), read back from the installed metadata, and enforced
where they matter (transformers when ``retmask.hf`` is imported, accelerate and gguf before a GGUF file is
converted): too old or missing raises naming the fix, too new warns."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import warnings

import pytest
import transformers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from retmask.errors import UsageError
from retmask.hf import loading
from retmask.hf.loading import ModelLoadError
from retmask.methods.retmask.dpo import train_dpo, train_sft
from retmask.requirements import (
    UnsupportedReleaseError,
    UntestedReleaseWarning,
    check_release,
    declared_range,
    installed_version,
)

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
RANGE = SpecifierSet(">=5.24,<6")


@pytest.mark.parametrize(
    ("package", "extra"),
    [("transformers", None), ("accelerate", None), ("gguf", None), ("trl", "train"), ("datasets", "train")],
)
def test_installed_metadata_declares_the_pyproject_range_and_it_holds_here(package, extra):
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    dependencies = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    (declared,) = [Requirement(d).specifier for d in dependencies if Requirement(d).name == package]
    assert declared_range(package, extra) == declared
    assert declared.contains(installed_version(package), prereleases=True)
    assert declared.contains(transformers.__version__) or package != "transformers"


@pytest.mark.parametrize("found", ["5.0.0", "5.23.0", "4.57.6", "5.24.0.dev0"])
def test_an_older_release_raises_naming_the_fix(found):
    fix = 'pip install "transformers>=5.24,<6"'
    with pytest.raises(
        UnsupportedReleaseError, match=rf"found transformers {found}: older .*Fix: {fix}"
    ) as err:
        check_release("transformers", found, RANGE)
    assert isinstance(err.value, ImportError) and isinstance(err.value, UsageError)


@pytest.mark.parametrize("train", [train_dpo, train_sft])
def test_training_without_trl_names_the_train_extra(train, monkeypatch, tmp_path):
    real = installed_version
    monkeypatch.setattr("retmask.requirements.installed_version", lambda p: None if p == "trl" else real(p))
    fix = r'pip install "trl>=1.16" \(it comes with retmask\'s "train" extra\)'
    with pytest.raises(UnsupportedReleaseError, match=rf"needs trl>=1.16, which is not installed .*{fix}"):
        train(tmp_path / "pairs.jsonl", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_missing_package_raises_naming_the_fix():
    with pytest.raises(
        ImportError, match=r'accelerate>=1.1, which is not installed.*pip install "accelerate>=1.1"'
    ):
        check_release("accelerate", None, SpecifierSet(">=1.1"))


@pytest.mark.parametrize("found", ["6.0.0", "6.2.1"])
def test_a_newer_release_warns(found):
    with pytest.warns(UntestedReleaseWarning, match=rf"found transformers {found}"):
        check_release("transformers", found, RANGE)


@pytest.mark.parametrize("found", ["5.24.0", "5.31.2", "5.25.0.dev0"])
def test_a_release_inside_the_range_passes_silently(found):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_release("transformers", found, RANGE)
        check_release("transformers", "1.0", None)  # no metadata (a source tree on sys.path): no check


def test_a_command_under_an_old_release_prints_the_fix_in_one_line():
    """Importing ``retmask.hf`` checks the release; a command reports it as a usage error (exit 2)."""
    code = (
        "import sys, transformers\n"
        "transformers.__version__ = '5.3.0'\n"
        "from retmask.cli import main\n"
        "sys.exit(main(['detect', '--out', sys.argv[1], '--max-len', '600', '--min-len', '500']))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, "/nonexistent/s.json"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2, run.stderr
    fix = 'pip install "transformers>=5.24,<6"'
    assert (
        "retmask detect: error: retmask needs transformers>=5.24,<6, found transformers 5.3.0" in run.stderr
    )
    assert fix in run.stderr and "Traceback" not in run.stderr


def test_gguf_conversion_under_an_old_accelerate_names_it_not_a_damaged_file(tmp_path, monkeypatch):
    """transformers' own error for this case is a ValueError that reads like a torn download's."""
    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path / "cache"))
    real = installed_version
    monkeypatch.setattr(
        "retmask.requirements.installed_version", lambda p: "1.0.0" if p == "accelerate" else real(p)
    )
    gguf = tmp_path / "model.gguf"
    with open(loading.embedded_gguf_path(), "rb") as f:
        gguf.write_bytes(f.read(65536))  # a valid header: the check must come before any reading
    with pytest.raises(
        ModelLoadError, match=rf"cannot convert GGUF file {gguf}: .*found accelerate 1\.0\.0"
    ) as err:
        loading.load_model(str(gguf))
    assert "damaged" not in str(err.value)
