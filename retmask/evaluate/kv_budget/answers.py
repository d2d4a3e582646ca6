"""The tests of a KV-budget run and one configuration's answers to them (``model.generate`` per test)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from retmask.evaluate.kv_budget.plan import KVBudgetError

KV_TASK_SEED = 0  # the key-value lists of `retmask eval`'s default seed: every configuration sees the same


@dataclass
class Item:
    """One question: ``prompt_ids`` int64 [n]; ``target`` the needle sentence (NIAH, scored by ROUGE-1
    recall) or the value (key–value, exact match of the first number)."""

    task: str
    key: str
    length: int
    depth: int
    prompt_ids: Any
    target: str

    def score(self, response: str) -> float:
        """In [0, 1]: the NIAH ROUGE-1 recall of the needle, or 1.0 / 0.0 for the key–value answer."""
        if self.task == "niah":
            from retmask.niah import rouge1_recall

            return float(rouge1_recall(self.target, response))
        from retmask.evaluate.synthetic import exact_number

        return 1.0 if exact_number(self.target, response) else 0.0


def build_items(
    tokenizer: Any,
    tasks: Sequence[str],
    *,
    lengths: Sequence[int],
    depths: Sequence[int],
    needles: Sequence[Any],
    haystack_text: str,
    prompt_style: str,
) -> tuple[list[Item], list[dict]]:
    """(items, skipped NIAH tests): the NIAH grid (``retmask.niah.build_tests``, the detection protocol's
    prompts) and/or the key–value lists of ``retmask eval`` at the same lengths, asked at the same depths
    (percent of the list). ``prompt_style``: the resolved one, "chat" or "base"."""
    from retmask.evaluate.synthetic import kv_items
    from retmask.niah import build_tests

    items: list[Item] = []
    skipped: list[dict] = []
    if "niah" in tasks:
        tests = build_tests(tokenizer, needles, haystack_text, lengths, depths, chat=prompt_style == "chat")
        for t in tests:
            if t.insertion < 0:
                skipped.append({"key": t.key, "reason": t.skip_reason})
                continue
            items.append(
                Item("niah", t.key, t.length, t.depth, t.prompt_ids, needles[t.needle_index].real_needle)
            )
        if not any(i.task == "niah" for i in items):
            raise KVBudgetError(
                f"no NIAH test can run: all {len(tests)} contexts are too short for the needle and its buffer "
                f"(e.g. {tests[-1].skip_reason}); raise --min-len/--max-len"
            )
    if "kv" in tasks:
        try:
            kv = kv_items(tokenizer, lengths, depths, seed=KV_TASK_SEED)
        except ValueError as err:
            raise KVBudgetError(f"key-value task: {err}") from None
        items += [Item("kv", k.key, k.length, k.depth, k.prompt_ids, k.answer) for k in kv]
    return items, skipped


def cache_bytes(cache: Any) -> int:
    """Bytes a cache holds: ``memory_bytes()`` of a head-sparse cache (allocated buffers), else the K and
    V tensors of every initialised layer (a ``DynamicCache``)."""
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    total = 0
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)
    return total


def run_config(
    model: Any,
    tokenizer: Any,
    items: Sequence[Item],
    full_heads: list[tuple[int, int]] | None,
    *,
    window: int,
    sink_tokens: int,
    prefill: str = "windowed",
    max_new_tokens: int,
    stop_ids: Iterable[int],
    progress: bool = False,
    desc: str = "kv",
    done: Mapping[int, dict] | None = None,
    on_entry: Callable[[Mapping[int, dict]], None] | None = None,
) -> list[dict]:
    """Answer every item with ``model.generate`` (greedy, at most ``max_new_tokens``, stopping after a
    newline / EOS token) on a new cache per item: a ``DynamicCache`` when ``full_heads`` is None, else a
    head-sparse cache keeping ``full_heads`` whole. Returns one entry per item with its response, score
    and the bytes the cache held after generation (and what the full cache holds for the same tokens).

    done: the entries of an interrupted run of the same configuration by item index (a progress file's):
    those items are not answered again. on_entry: called after each answered item with every entry so far
    by item index, e.g. to save them.
    """
    import torch
    from tqdm import tqdm
    from transformers import DynamicCache, GenerationConfig

    import retmask
    from retmask.hf.generation import _only_config

    eos = sorted(int(i) for i in stop_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad, use_cache=True
    )
    device = next(model.parameters()).device
    entries = _checked_done(done or {}, items)
    # the model's own generation defaults (repetition penalty, ...) set aside: the answer is the argmax
    with (
        torch.no_grad(),
        _only_config(model),
        tqdm(
            total=len(items), initial=len(entries), desc=desc, unit="test", disable=not progress, leave=False
        ) as bar,
    ):
        for index, it in enumerate(items):
            if index in entries:
                continue
            ids = torch.as_tensor(it.prompt_ids, dtype=torch.long, device=device)[None]
            if full_heads is None:
                cache = DynamicCache(config=model.config)
            else:
                # reserved at prompt + new tokens: the full heads' buffers are allocated once, at most
                # max_new_tokens positions more than they end up holding (not grown by 1/8 past the prompt)
                cache = retmask.head_sparse_cache(
                    model, full_heads=full_heads, window=window, sink_tokens=sink_tokens, prefill=prefill,
                    max_length=ids.shape[1] + max_new_tokens,
                )  # fmt: skip
            t0 = time.perf_counter()
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                cache=cache,
            )  # fmt: skip
            seconds = time.perf_counter() - t0
            tokens = out[0, ids.shape[1] :].tolist()
            response = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            held = cache_bytes(cache)
            full = held if full_heads is None else int(cache.full_cache_bytes())
            entries[index] = {
                "task": it.task, "key": it.key, "length": it.length, "depth": it.depth,
                "prompt_tokens": int(ids.shape[1]), "new_tokens": len(tokens), "response": response,
                "recall": it.score(response), "memory_bytes": held, "full_cache_bytes": full,
                "seconds": round(seconds, 3),
            }  # fmt: skip
            del cache, out
            if on_entry is not None:
                on_entry(entries)
            bar.update(1)
    return [entries[i] for i in range(len(items))]


def _checked_done(done: Mapping[int, dict], items: Sequence[Item]) -> dict[int, dict]:
    """``done`` as a new dict of entries without their ``"index"``, after checking that each answers the
    item at its index (same task, key, length and depth)."""
    checked: dict[int, dict] = {}
    for index, entry in done.items():
        saved = tuple(entry.get(k) for k in ("task", "key", "length", "depth"))
        it = items[index] if 0 <= index < len(items) else None
        if it is None or saved != (it.task, it.key, it.length, it.depth):
            raise KVBudgetError(
                f"an earlier answer for test {index} ({entry.get('key')!r}) is not this run's test {index} "
                "(another grid, needles or haystack wrote it); pass --overwrite to start over"
            )
        checked[index] = {k: v for k, v in entry.items() if k != "index"}
    return checked
