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


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct on retmask attention (loaded once)."""
    import retmask  # after TRITON_INTERPRET is set

    return retmask.load_model()
