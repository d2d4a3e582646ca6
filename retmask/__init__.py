"""retmask: find the retrieval heads of a language model, switch them off, and train with the contrast.

``import retmask`` registers ``attn_implementation="retmask"`` with transformers (TRL recreates reference
models by name, so registration must not wait for an explicit call).
"""

__version__ = "0.1.0"

from . import kernels
from .attention import capture_argmax, clear_head_mask, head_mask, patch, set_head_mask
from .hf.taps import tap_qk
from .masking import export_masked
from .models import default_model_path, load_model

__all__ = [
    "__version__",
    "capture_argmax",
    "clear_head_mask",
    "default_model_path",
    "export_masked",
    "head_mask",
    "kernels",
    "load_model",
    "patch",
    "set_head_mask",
    "tap_qk",
]
