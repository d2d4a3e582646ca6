"""The files a local model is made of, two identities built from them, and the processor files a saved
checkpoint carries over.

* ``content_identity``: the sha256 of the files' bytes. Reads every weight: for results cached across runs
  and machines (``retmask eval``), where minutes of hashing are small against the evaluation they save.
* ``files_stamp``: their sizes and modification times, read from the file system in microseconds. For the
  fingerprint a resumed run must share with its progress files: a model folder trained again, or a file
  replaced in between, is then another model and the resume is refused, instead of mixing two models'
  results in one output.

A model that is not a local path (a hub id; ``None``, the embedded model) has no files here: it is named
by its spec alone.
"""

from __future__ import annotations

import hashlib
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# besides the weights, what decides a model's prompts and context length
PROMPT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                "special_tokens_map.json", "chat_template.jinja", "chat_template.json")  # fmt: skip

# A vision-language model's image and video processing: neither model nor tokenizer, so what a run saves
# (a trained or exported checkpoint) carries them over from the source folder, for use with images.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


def copy_processor_files(model: Any, dest: Path) -> list[str]:
    """Copy the ``PROCESSOR_FILES`` of the folder ``model`` was loaded from (``model.name_or_path``) into
    ``dest`` where ``dest`` lacks them; returns the names copied (none for a model not loaded from a local
    folder)."""
    name = str(getattr(model, "name_or_path", "") or "")
    source = Path(name).expanduser()
    if not name or not source.is_dir() or source.resolve() == dest.resolve():
        return []
    copied = []
    for file in PROCESSOR_FILES:
        if (source / file).is_file() and not (dest / file).exists():
            shutil.copyfile(source / file, dest / file)
            copied.append(file)
    return copied


def model_files(path: Path) -> list[Path]:
    """``path`` itself when it is a file (a GGUF); for a folder its weight files (``*.safetensors``,
    ``*.bin`` but ``training_args.bin``) and, when it has weights, the files of ``PROMPT_FILES`` it holds; []
    when it has none."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    # *.bin but the Trainer's training_args.bin: a pickle of the run's arguments (its output path, logging
    # folder), which would make two identical trainings' weights two models
    bins = [p for p in sorted(path.glob("*.bin")) if p.name != "training_args.bin"]
    files = sorted(path.glob("*.safetensors")) + bins
    return files + [path / n for n in PROMPT_FILES if (path / n).is_file()] if files else []


def content_identity(path: Path) -> str | None:
    """``"sha256:<hex>"`` of the bytes of ``model_files(path)`` in order, or None when there are none."""
    files = model_files(path)
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while block := fh.read(1 << 24):
                h.update(block)
    return "sha256:" + h.hexdigest()


def files_stamp(spec: str | None, gguf_file: str | None = None) -> dict[str, str]:
    """``{"model_files": "<bytes> bytes in <n> files, last modified <UTC time>, stamp <hex>"}`` for a local
    model ``spec`` (the hex: sha256 of every file's name, size and modification time in nanoseconds, so a
    change to any one file shows), or {} for a spec that is no local path: a fingerprint entry that names
    the change readably in a refused resume's message. ``gguf_file``: a GGUF file name inside ``spec``, or
    its path when ``spec`` is None (as ``retmask.load_model`` takes them)."""
    if gguf_file is not None:
        path = Path(gguf_file) if spec is None else Path(spec) / gguf_file
    else:
        path = Path(spec) if spec else None
    files = model_files(path.expanduser()) if path is not None else []
    if not files:
        return {}
    stats = [(f.name, f.stat()) for f in files]
    size = sum(s.st_size for _, s in stats)
    newest = datetime.fromtimestamp(max(s.st_mtime_ns for _, s in stats) / 1e9, tz=timezone.utc)
    stamp = hashlib.sha256(repr([(n, s.st_size, s.st_mtime_ns) for n, s in stats]).encode()).hexdigest()[:12]
    when = newest.isoformat(timespec="microseconds").replace("+00:00", "Z")
    return {"model_files": f"{size} bytes in {len(files)} files, last modified {when}, stamp {stamp}"}
