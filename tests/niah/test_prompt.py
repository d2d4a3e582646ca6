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

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
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
