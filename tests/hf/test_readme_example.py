"""The README's Python example runs as written, on the embedded model (a user's first lines must work)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_model_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    example = next(b for b in blocks if "retmask.load_model()" in b)
    scope: dict = {}
    exec(compile(example, "README.md example", "exec"), scope)  # noqa: S102 (our own README)
    model = scope["model"]
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    assert scope["cap"].last.shape[:3] == (layers, 1, heads) and scope["cap"].last.shape[3] == 4
    generated = scope["out"]
    assert generated.dtype == torch.long and generated.shape[1] > 1
    # the in-place cache holds the prompt and every generated token but the last
    assert scope["cache"].get_seq_length() == generated.shape[1] - 1
