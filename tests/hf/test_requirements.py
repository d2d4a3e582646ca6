"""The transformers range: declared once (pyproject.toml), read back from the installed metadata, and
enforced when ``retmask.hf`` is imported (too old: an ImportError naming the fix; too new: a warning)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import warnings

import pytest
import transformers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from retmask.hf.requirements import UntestedTransformersWarning, check_transformers, declared_range

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
RANGE = SpecifierSet(">=5.24,<6")


def test_installed_metadata_declares_the_pyproject_range():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (declared,) = [Requirement(d).specifier for d in dependencies if Requirement(d).name == "transformers"]
    assert declared_range() == declared
    assert declared_range().contains(transformers.__version__, prereleases=True)


@pytest.mark.parametrize("found", ["5.0.0", "5.23.0", "4.57.6", "5.24.0.dev0"])
def test_an_older_release_raises_naming_the_fix(found):
    with pytest.raises(
        ImportError, match=rf'found transformers {found}\b.*pip install "transformers>=5.24,<6"'
    ):
        check_transformers(found, RANGE)


@pytest.mark.parametrize("found", ["6.0.0", "6.2.1"])
def test_a_newer_release_warns(found):
    with pytest.warns(UntestedTransformersWarning, match=rf"found transformers {found}"):
        check_transformers(found, RANGE)


@pytest.mark.parametrize("found", ["5.24.0", "5.31.2", "5.25.0.dev0"])
def test_a_release_inside_the_range_passes_silently(found):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_transformers(found, RANGE)
        check_transformers("1.0", None)  # no metadata (a source tree on sys.path): nothing to check


def test_importing_retmask_hf_under_an_old_release_fails_with_the_fix():
    code = "import transformers\ntransformers.__version__ = '5.3.0'\nimport retmask.hf\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "ImportError: retmask needs transformers>=5.24,<6, found transformers 5.3.0" in run.stderr
