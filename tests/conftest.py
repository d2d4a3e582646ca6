"""Session-wide test setup.

Triton kernels run in the interpreter on machines without a GPU. ``TRITON_INTERPRET`` is read when a
kernel is decorated, so it must be set before any retmask Triton module is imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# The CPU backend measures which of its two paths is faster for each kind of call and caches the choice
# (retmask.kernels.cpu_autotune). Tests pin the fused kernel so that no result depends on this machine's
# timing; tests of the measurement set "auto" themselves (and subprocesses inherit the pin).
os.environ.setdefault("RETMASK_CPU_PATH", "cpp")
# Likewise the float32 CPU linears keep torch's own backend (retmask.kernels.linear_cpu measures oneDNN
# against it); the tests of that module and of the patched models force "onednn" or "auto" themselves.
os.environ.setdefault("RETMASK_CPU_LINEAR", "torch")
os.environ.setdefault("RETMASK_CPU_ATTN_BWD", "kernel")  # no measuring in tests (test_backward_choice does)


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct on retmask attention (loaded once)."""
    import retmask  # after TRITON_INTERPRET is set

    return retmask.load_model()
