"""Stop tokens of the decoding: any token whose text contains a newline, and the EOS ids."""

from __future__ import annotations


def stop_token_ids(tokenizer, model=None) -> frozenset[int]:
    """Ids that end the answer *after* being generated (newline tokens and EOS).

    The reference stops on its tokenizer's newline token (``<0x0A>``); byte-level BPE vocabularies also
    have merged tokens such as ``"\\n\\n"`` or ``".\\n"``, so every token whose decoded text contains a newline
    counts. EOS: the tokenizer's and the model's generation config's (chat models end turns with e.g.
    ``<|im_end|>``).
    """
    ids: set[int] = set()
    vocab = tokenizer.get_vocab()
    # Decoding one id at a time for the whole vocabulary is slow-ish (~1 s for 50K), but done once per run.
    for tid in vocab.values():
        if "\n" in tokenizer.decode([tid]):
            ids.add(tid)
    eos = [tokenizer.eos_token_id]
    gen = getattr(model, "generation_config", None) if model is not None else None
    if gen is not None and gen.eos_token_id is not None:
        eos += gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    ids.update(int(e) for e in eos if e is not None)
    return frozenset(ids)
