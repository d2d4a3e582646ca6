"""The files a local model is made of (``retmask.model_files``): the stamp that resume fingerprints carry
changes with any one file and is stable otherwise; the content identity follows the bytes alone."""

from __future__ import annotations

import os
from pathlib import Path

from retmask.model_files import content_identity, files_stamp, model_files


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model-00001-of-00002.safetensors").write_bytes(os.urandom(300))
    (folder / "model-00002-of-00002.safetensors").write_bytes(os.urandom(200))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "README.md").write_text("not part of the model")
    return folder


def _later(path: Path) -> None:
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def test_model_files_are_the_weights_and_prompt_files(tmp_path):
    folder = _folder(tmp_path)
    assert [p.name for p in model_files(folder)] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json",
    ]  # fmt: skip
    assert model_files(tmp_path / "missing") == []
    # the Trainer's pickled arguments (output path, logging folder) are not the model; old-style weights are
    (folder / "training_args.bin").write_bytes(os.urandom(50))
    identity = content_identity(folder)
    (folder / "training_args.bin").write_bytes(os.urandom(50))
    assert content_identity(folder) == identity
    (folder / "pytorch_model.bin").write_bytes(os.urandom(50))
    assert (
        "pytorch_model.bin" in [p.name for p in model_files(folder)] and content_identity(folder) != identity
    )
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert model_files(tmp_path / "empty") == []  # no weights: not a model folder
    assert files_stamp(str(tmp_path / "empty")) == {} and content_identity(tmp_path / "empty") is None


def test_stamp_changes_with_any_one_file_and_only_then(tmp_path):
    folder = _folder(tmp_path)
    first = files_stamp(str(folder))["model_files"]
    assert (
        first.startswith("523 bytes in 3 files, last modified ")
        and first == files_stamp(str(folder))["model_files"]
    )
    (folder / "README.md").write_text("edited")  # not a model file
    assert files_stamp(str(folder))["model_files"] == first
    for name in ("model-00002-of-00002.safetensors", "config.json"):
        _later(folder / name)  # a second later, same bytes
        again = files_stamp(str(folder))["model_files"]
        assert again != first
        first = again
    identity = content_identity(folder)
    assert identity is not None and identity == content_identity(folder)  # times do not enter the content
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    assert content_identity(folder) != identity


def test_stamp_of_a_gguf_file_and_of_specs_that_are_no_local_path(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(60))
    stamp = files_stamp(str(gguf))
    assert stamp["model_files"].startswith("64 bytes in 1 files")
    assert files_stamp(str(tmp_path), gguf_file="m.gguf") == stamp == files_stamp(None, gguf_file=str(gguf))
    assert files_stamp(None) == {} and files_stamp("HuggingFaceTB/SmolLM2-135M-Instruct") == {}
