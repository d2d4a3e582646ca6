"""The NIAH prompt style: auto / base / chat, resolved per tokenizer and recorded."""

from __future__ import annotations

import pytest

from retmask.niah import build_prompt_ids, resolve_prompt_style


class _Tok:
    """A stand-in tokenizer: one id per character; a chat template when ``chat``."""

    def __init__(self, chat: bool):
        self.chat_template = "{{ messages }}" if chat else None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([0] if add_special_tokens else []) + [ord(c) for c in text]}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **template_kwargs):
        return "<user>" + messages[0]["content"] + "<assistant>"


def test_resolve_prompt_style():
    chat, base = _Tok(True), _Tok(False)
    assert resolve_prompt_style(chat, "auto") == "chat" and resolve_prompt_style(base, "auto") == "base"
    assert resolve_prompt_style(chat, "base") == "base"
    with pytest.raises(ValueError, match="--prompt-style chat needs a tokenizer with a chat template"):
        resolve_prompt_style(base, "chat")
    with pytest.raises(ValueError, match="--prompt-style must be one of auto, base, chat"):
        resolve_prompt_style(base, "instruct")


def test_base_and_chat_prompts_differ_as_documented():
    tok = _Tok(True)
    base = build_prompt_ids(tok, "CTX ", "Q?", chat=False)
    chat = build_prompt_ids(tok, "CTX ", "Q?", chat=True)
    assert "".join(map(chr, base[1:])) == "CTX Based on the content of the book, Question: Q?\nAnswer:"
    assert "".join(map(chr, chat)).startswith("<user><book>CTX </book>")


# A thinking model's template (Qwen3's switch): an empty think block when reasoning is off.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_prompts_switch_reasoning_off():
    """A thinking model would open its answer with "<think>" and a newline, which ends a NIAH answer: the
    NIAH and key-value prompts pass enable_thinking=False through the real template engine."""
    from transformers import AutoTokenizer

    import retmask
    from retmask.evaluate.synthetic import kv_items

    tok = AutoTokenizer.from_pretrained(str(retmask.default_model_path()))
    tok.chat_template = THINKING_TEMPLATE
    text = tok.decode(build_prompt_ids(tok, "CTX ", "Q?", chat=True))
    assert (
        text
        == "<|user|><book>CTX </book>\nBased on the content of the book, Question: Q?\nAnswer:<|assistant|><think>\n\n</think>\n\n"
    )
    kv = kv_items(tok, [300], [50])
    assert tok.decode(kv[0].prompt_ids).endswith("<|assistant|><think>\n\n</think>\n\n")
