"""The resumable per-configuration result folder shared by `retmask ablate` and `retmask kv`."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from retmask.errors import UsageError
from retmask.evaluate.config_runs import ConfigFolder, remaining


class FolderError(UsageError):
    pass


@dataclass
class Config:
    name: str


def test_saved_results_are_refused_deleted_or_returned_by_the_flags(tmp_path):
    folder = ConfigFolder(tmp_path, "run", FolderError)
    assert folder.saved(resume=False, overwrite=False) == []  # no folder yet
    folder.save("b", {"x": 2})
    folder.save("a", {"x": 1})
    files = sorted((tmp_path / "run.configs").glob("*.json"))
    assert [p.stem for p in files] == ["a", "b"]
    assert json.loads(files[0].read_text()) == {"x": 1}
    with pytest.raises(FolderError, match=r"already holds 2 configuration results; pass --resume"):
        folder.saved(resume=False, overwrite=False)
    assert folder.saved(resume=True, overwrite=False) == files
    assert folder.saved(resume=False, overwrite=True) == []
    assert list((tmp_path / "run.configs").glob("*.json")) == []  # deleted, not mixed into the new run


def test_without_an_out_dir_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = ConfigFolder(None, "run", FolderError)
    folder.save("a", {"x": 1})
    assert folder.saved(resume=True, overwrite=False) == []
    assert list(tmp_path.iterdir()) == []


def test_remaining_skips_done_configurations_and_stops_at_the_limit():
    configs = [Config(n) for n in "abcde"]
    assert [c.name for c in remaining(configs, {"b"}, limit=None, desc="t", progress=False)] == [
        "a",
        "c",
        "d",
        "e",
    ]
    assert [c.name for c in remaining(configs, {"a", "c"}, limit=2, desc="t", progress=False)] == ["b", "d"]
    assert list(remaining(configs, set("abcde"), limit=1, desc="t", progress=False)) == []
