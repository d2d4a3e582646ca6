"""``import retmask`` alone registers the attention and mask functions (TRL reloads models by name)."""

from __future__ import annotations

import subprocess
import sys


def test_import_registers_attention_and_mask():
    code = (
        "import retmask\n"
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "assert AttentionInterface._global_mapping['retmask'] is retmask.attention.retmask_attention\n"
        "assert AttentionMaskInterface._global_mapping['retmask'] is retmask.attention.retmask_mask\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
