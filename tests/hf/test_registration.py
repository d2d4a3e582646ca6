"""``import retmask`` alone registers the attention and mask functions (TRL reloads models by name)."""

from __future__ import annotations

import subprocess
import sys


def test_import_registers_attention_and_mask():
    code = (
        "import retmask\n"
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "assert AttentionInterface._global_mapping['retmask'] is retmask.hf.retmask_attention\n"
        "assert AttentionMaskInterface._global_mapping['retmask'] is retmask.hf.retmask_mask\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_is_light_and_registers_when_transformers_comes_later():
    """``import retmask`` imports neither torch nor transformers; the first ``import transformers`` after it
    registers "retmask" (import hook), so ``from_config(..., attn_implementation="retmask")`` works, and the
    lazy API (``retmask.head_mask``, ``retmask.load_model``, ...) resolves on first use."""
    code = (
        "import sys\n"
        "import retmask\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'import retmask is heavy'\n"
        "from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "cfg = LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
        "                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)\n"
        "model = AutoModelForCausalLM.from_config(cfg, attn_implementation='retmask').eval()\n"
        "assert model.config._attn_implementation == 'retmask'\n"
        "import torch\n"
        "ids = torch.tensor([[1, 2, 3, 4]])\n"
        "with torch.no_grad():\n"
        "    full = model(ids).logits\n"
        "    with retmask.head_mask(model, [(0, 1)]):\n"
        "        masked = model(ids).logits\n"
        "assert not torch.equal(full, masked)\n"
        "for name in retmask.__all__:\n"
        "    assert getattr(retmask, name) is not None, name\n"
        "assert callable(retmask.load_model) and callable(retmask.export_masked)\n"
        "assert retmask.kernels.attention is not None\n"
        "from transformers import AttentionInterface\n"
        "assert AttentionInterface._global_mapping['retmask'] is retmask.hf.retmask_attention\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_registers_at_once_when_transformers_is_already_imported():
    code = (
        "import transformers\n"
        "from transformers import AttentionInterface\n"
        "assert 'retmask' not in AttentionInterface._global_mapping\n"
        "import retmask\n"
        "assert AttentionInterface._global_mapping['retmask'] is retmask.hf.retmask_attention\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_unknown_attribute_is_an_attribute_error():
    import pytest

    import retmask

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        retmask.nope  # noqa: B018
