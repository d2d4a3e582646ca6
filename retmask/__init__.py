"""retmask: find the retrieval heads of a language model, switch them off, and train with the contrast.

``import retmask`` is cheap: it imports neither torch nor transformers (so ``retmask --help`` is instant).
The public API below is loaded on first use (PEP 562 module ``__getattr__``).

``import retmask`` still registers ``attn_implementation="retmask"`` with transformers (TRL recreates
reference models by name, so registration must not wait for an explicit call): at once if transformers is
already imported, otherwise right after transformers is first imported, by a one-shot import hook
(:class:`_RegisterWithTransformers`). Registration imports ``retmask.hf.interface`` (torch + the kernels).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first attribute access)
_LAZY = {
    "capture_argmax": "retmask.hf",
    "clear_head_mask": "retmask.hf",
    "head_mask": "retmask.hf",
    "patch": "retmask.hf",
    "patch_linears": "retmask.hf.linears",
    "set_head_mask": "retmask.hf",
    "export_masked": "retmask.hf.export",
    "generate_copies": "retmask.hf.generation",
    "growing_cache": "retmask.hf.kv_cache",
    "head_sparse_cache": "retmask.hf.sparse_kv.cache",
    "default_model_path": "retmask.hf.loading",
    "load_model": "retmask.hf.loading",
    "tap_qk": "retmask.hf.taps",
}
_SUBMODULES = {"kernels"}

__all__ = [
    "__version__",
    "capture_argmax",
    "clear_head_mask",
    "default_model_path",
    "export_masked",
    "generate_copies",
    "growing_cache",
    "head_mask",
    "head_sparse_cache",
    "kernels",
    "load_model",
    "patch",
    "patch_linears",
    "set_head_mask",
    "tap_qk",
]

if TYPE_CHECKING:  # static analysers and IDEs see the real objects
    from retmask import kernels
    from retmask.hf import capture_argmax, clear_head_mask, head_mask, patch, set_head_mask
    from retmask.hf.export import export_masked
    from retmask.hf.generation import generate_copies
    from retmask.hf.kv_cache import growing_cache
    from retmask.hf.linears import patch_linears
    from retmask.hf.loading import default_model_path, load_model
    from retmask.hf.sparse_kv.cache import head_sparse_cache
    from retmask.hf.taps import tap_qk


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_INTERFACE = "retmask.hf.interface"  # importing it registers "retmask" (attention + mask function)


def _register() -> None:
    if _INTERFACE in sys.modules:
        return  # registered already, or being imported now (it registers when its import finishes)
    try:
        importlib.import_module(_INTERFACE)
    except Exception as err:  # never break `import transformers` for the whole process
        import warnings

        warnings.warn(
            f"retmask: could not register attn_implementation='retmask' with transformers: {err!r}",
            RuntimeWarning,
            stacklevel=2,
        )


class _RegisterWithTransformers(importlib.abc.MetaPathFinder):
    """One-shot import hook: when ``transformers`` is first imported, let the normal finders find it, and
    run :func:`_register` right after its ``__init__`` has executed (the module's loader is untouched apart
    from that one call, so ``module.__loader__``/resources behave as usual)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "transformers":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot, and no recursion below
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_register(module: Any) -> None:
            try:
                exec_module(module)
            finally:
                try:
                    del loader.exec_module  # restore the class's method
                except AttributeError:
                    pass
            _register()

        loader.exec_module = exec_then_register
        return spec


if "transformers" in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterWithTransformers) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithTransformers())
