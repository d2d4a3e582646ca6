"""The NIAH prompt, identical to the reference script's two templates."""

from __future__ import annotations

CHAT_TEMPLATE_USER = "<book>{context}</book>\nBased on the content of the book, Question: {question}\nAnswer:"
BASE_TEMPLATE = "{context}Based on the content of the book, Question: {question}\nAnswer:"


PROMPT_STYLES = ("auto", "base", "chat")


def resolve_prompt_style(tokenizer, style: str = "auto") -> str:
    """``"base"`` or ``"chat"``: the template a run uses. ``auto`` = chat when the tokenizer has a chat
    template (instruction-tuned models), base otherwise (base models such as Gemma-3-270M). Recorded in
    every run record, since the two templates give different prompts and different scores."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"--prompt-style must be one of {', '.join(PROMPT_STYLES)}, got {style!r}")
    if style == "auto":
        return "chat" if is_chat_tokenizer(tokenizer) else "base"
    if style == "chat" and not is_chat_tokenizer(tokenizer):
        raise ValueError(
            "--prompt-style chat needs a tokenizer with a chat template, and this one has none (a base "
            "model?); use --prompt-style base (or auto)"
        )
    return style


def is_chat_tokenizer(tokenizer) -> bool:
    """Chat models are recognised by their tokenizer having a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_text(tokenizer, content: str) -> str:
    """One user message ``content`` through the chat template, with the generation prompt, as text.

    Reasoning is switched off (``enable_thinking=False``; templates without that switch ignore it): a
    thinking model such as Qwen3 would otherwise open its answer with ``<think>`` and a newline, which ends a
    NIAH answer (decoding stops at a newline) before any of the needle. RetMask disables reasoning for Qwen3
    when it computes retrieval scores.
    """
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


def build_prompt_ids(tokenizer, context: str, question: str, chat: bool | None = None) -> list[int]:
    """Prompt token ids.

    Chat: the chat template with one user message and the generation prompt (reasoning off:
    :func:`chat_prompt_text`); the template's text already holds any BOS, so it is tokenised without adding special tokens. Base: ``context + question`` tokenised
    with the tokenizer's special tokens (a BOS where the model uses one), like the reference.
    """
    if chat is None:
        chat = is_chat_tokenizer(tokenizer)
    if chat:
        text = chat_prompt_text(tokenizer, CHAT_TEMPLATE_USER.format(context=context, question=question))
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(BASE_TEMPLATE.format(context=context, question=question))["input_ids"])
