"""Context construction exactly as the reference detection script: keep ``L - 200 - |needle|`` haystack
tokens and insert the needle after the sentence end at or before the depth."""

from __future__ import annotations

from collections.abc import Collection, Sequence

DEFAULT_BUFFER = 200  # tokens left for the template, the question and the answer (reference value)


def period_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the sentence-ending period: the tokenisation of ``"."`` (the reference's generic rule), plus
    the id a period gets right after a word. They differ for SentencePiece tokenizers that add a dummy
    prefix (Llama 2, Mistral): ``"."`` alone is ``"▁."``, which never ends a sentence mid-text, so the walk
    back would always run to the start of the context (the published script lists both ids of those
    models by hand). Byte-level BPE tokenizers (SmolLM2, Llama 3) and Gemma's give one id either way."""
    ids = set(tokenizer(".", add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError("the tokenizer encodes '.' to no tokens; cannot find sentence ends")
    word = tokenizer("sentence", add_special_tokens=False)["input_ids"]
    ended = tokenizer("sentence.", add_special_tokens=False)["input_ids"]
    if len(ended) == len(word) + 1 and ended[: len(word)] == word:  # the period is a token of its own
        ids.add(ended[-1])
    return frozenset(ids)


def build_context_ids(
    haystack_ids: Sequence[int],
    needle_ids: Sequence[int],
    length: int,
    depth_percent: float,
    period_ids: Collection[int],
    buffer: int = DEFAULT_BUFFER,
) -> tuple[list[int], int]:
    """Context token ids with the needle inserted, and the insertion point ``p`` (in haystack tokens).

    1. keep the first ``length - buffer - len(needle_ids)`` haystack tokens;
    2. ``p = int(len(kept) * depth / 100)``, walked back until the token before ``p`` is a period (or 0);
       depth 100 puts the needle at the very end (the reference special-cases it, no walk back);
    3. ``kept[:p] + needle + kept[p:]``.
    """
    keep = length - buffer - len(needle_ids)
    if keep <= 0:
        raise ValueError(
            f"context length {length} leaves no haystack after the {buffer}-token buffer and the "
            f"{len(needle_ids)}-token needle; use a length > {buffer + len(needle_ids)}"
        )
    if len(haystack_ids) < keep:
        raise ValueError(f"haystack has {len(haystack_ids)} tokens, {keep} needed; pass a longer haystack")
    kept = list(haystack_ids[:keep])
    if depth_percent >= 100:
        p = len(kept)
    else:
        p = int(len(kept) * (depth_percent / 100))
        while p > 0 and kept[p - 1] not in period_ids:
            p -= 1
    return kept[:p] + list(needle_ids) + kept[p:], p
