"""A model folder that ships its own Python code (``auto_map``) is refused, and the code never runs.

transformers asks on a terminal whether to run such code when ``trust_remote_code`` is left unset; retmask
says ``False`` explicitly, so nothing is asked and nothing runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retmask.hf.loading import ModelLoadError, load_model
from tests.tiny import tiny_llama


def test_model_with_its_own_code_is_refused_without_running_it(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    tiny_llama(vocab=32).save_pretrained(folder)
    marker = tmp_path / "code-ran"
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="shipped_code",
        architectures=["ShippedModel"],
        auto_map={"AutoConfig": "shipped.ShippedConfig", "AutoModelForCausalLM": "shipped.ShippedModel"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "shipped.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["shipped.ShippedTokenizer", None]}})
    )
    with pytest.raises(ModelLoadError, match="never runs a model's code"):
        load_model(str(folder))
    assert not marker.exists()
