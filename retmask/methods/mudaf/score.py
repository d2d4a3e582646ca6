"""MuDAF's MDQA retrieval score of every attention head.

For each example (passages in prompt order, question last, the prompt ending with ``Answer:``) and each
head h, ``a_p`` = the attention mass from the last prompt token on the tokens of passage p. It is
computed from that one query row only: the post-RoPE query of the last prompt token and the keys of all
tokens are tapped from the attention call (``retmask.hf.taps``), one softmax over the keys of that row
is taken, as the layer computes it (a local layer's sliding window, logit soft-capping and attention
sinks included), and the probabilities are segment-summed over the passages' token spans. No attention matrix
is materialised: per layer the work is [B, Hq, N] logits. GQA: query head h uses KV head h // (Hq / Hkv).

Per example and head:
  F1  attended = {p : a_p > ε}; precision and recall against the golden set; F1 = 0 when nothing attended
  EM  1 if the top-|golden| passages by mass are exactly the golden ones (ties broken by prompt order)
Per head: the means over examples; ``R_h`` = mean F1.

ε defaults to 0.3, the threshold of the MuDAF reference code (the published method does not state one).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig

from retmask.hf.generation import generate_copies
from retmask.hf.layers import head_layout
from retmask.hf.loading import max_context
from retmask.hf.taps import tap_qk
from retmask.methods.mudaf.config import MDQAScoreConfig
from retmask.methods.mudaf.mdqa import MDQAError, MDQAExample, build_prompt, example_from_json
from retmask.plotting import head_heatmap
from retmask.runfiles import atomic_write_bytes, atomic_write_json


@dataclass
class MDQAScores:
    """Per-example, per-head results. Arrays are float64 [E, L, Hq]; ``masses[e]`` is float32 [L, Hq, P_e]."""

    example_ids: list[str]
    f1: np.ndarray
    em: np.ndarray
    golden_mass: np.ndarray  # total mass on the golden passages
    passage_mass: np.ndarray  # total mass on all passages
    masses: list[np.ndarray]
    config: MDQAScoreConfig
    seconds: float = 0.0
    prompt_tokens: list[int] = field(default_factory=list)
    golden: list[list[int]] = field(default_factory=list)  # golden passage indices per example
    resumed: int = 0  # examples whose masses an interrupted run computed (``seconds`` excludes them)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.f1.shape[1]), int(self.f1.shape[2])

    def mean(self, what: str = "f1") -> np.ndarray:
        """float64 [L, Hq]: the per-head mean of ``f1`` (R_h), ``em``, ``golden_mass`` or ``passage_mass``."""
        return getattr(self, what).mean(0)

    def scores_json(self) -> dict[str, list[float]]:
        """``{"layer-head": [per-example F1]}``, the detection scores format (``selection.load_scores``)."""
        num_layers, num_heads = self.shape
        return {
            f"{ly}-{h}": [round(float(x), 6) for x in self.f1[:, ly, h]]
            for ly in range(num_layers)
            for h in range(num_heads)
        }

    def record_json(self, **extra: Any) -> dict[str, Any]:
        """Settings, per-head means of every metric and per-example summaries."""
        num_layers, num_heads = self.shape

        def by_head(a: np.ndarray) -> dict[str, float]:
            return {
                f"{ly}-{h}": round(float(a[ly, h]), 6) for ly in range(num_layers) for h in range(num_heads)
            }

        return {
            "metric": "MuDAF MDQA retrieval score (F1 with threshold epsilon; EM = top-|golden| passages)",
            "config": asdict(self.config),
            "model_shape": [num_layers, num_heads],
            "examples": len(self.example_ids),
            "example_ids": self.example_ids,
            "prompt_tokens": self.prompt_tokens,
            "seconds": round(self.seconds, 2),
            "resumed_examples": self.resumed,
            "mean_f1": by_head(self.mean("f1")),
            "mean_em": by_head(self.mean("em")),
            "mean_golden_mass": by_head(self.mean("golden_mass")),
            "mean_passage_mass": by_head(self.mean("passage_mass")),
            **extra,
        }


# --------------------------------------------------------------------------------------------------
# The per-passage mass of one query row
# --------------------------------------------------------------------------------------------------


def last_row_masses(
    q: torch.Tensor,
    k: torch.Tensor,
    scaling: float,
    key_valid: torch.Tensor,
    segment: torch.Tensor,
    num_passages: int,
    *,
    query_pos: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention mass of one query row per passage, as the layer's attention computes it.

    q: [B, Hq, D] (the last prompt token's post-RoPE query); k: [B, Hkv, N, D] post-RoPE keys;
    key_valid: bool [B, N] (keys the row may attend: causal past and not padding);
    segment: int64 [B, N], the passage index of each key or -1 outside every passage.
    The layer's features (``QKTap.features``), each None when the layer has none:
    window: a sliding window, the row at position ``query_pos`` [B] (int64, required with a window) sees
    only keys ``j > query_pos - window``; softcap: logits become ``softcap * tanh(s / softcap)``;
    sinks: float [Hq], one logit per head that joins the softmax denominator and takes mass from every key.
    Returns float32 [B, Hq, P]: softmax over the allowed keys of ``scaling * q·k``, summed per passage.
    """
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    group = Hq // Hkv
    qf = q.float().view(B, Hkv, group, D)
    logits = torch.einsum("bkgd,bknd->bkgn", qf, k.float()).reshape(B, Hq, -1) * scaling  # [B, Hq, N]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    allowed = key_valid
    if window is not None:
        if query_pos is None:
            raise ValueError(
                "last_row_masses: a sliding window needs query_pos, the query row's position [B]"
            )
        keys = torch.arange(N, device=k.device)
        allowed = allowed & (keys[None, :] > query_pos[:, None] - window)
    logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.detach().float()[None, :, None].expand(B, Hq, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :N]
    else:
        probs = torch.softmax(logits, dim=-1)
    # Keys outside every passage go to an extra bin P that is dropped: a plain scatter-add segment sum.
    bins = torch.where(segment < 0, num_passages, segment)[:, None, :].expand(B, Hq, -1)
    out = torch.zeros(B, Hq, num_passages + 1, dtype=probs.dtype, device=probs.device)
    out.scatter_add_(2, bins, probs)
    return out[:, :, :num_passages]


def f1_em(masses: torch.Tensor, golden: Sequence[int], epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """masses: float [..., P]; golden: passage indices -> (F1, EM), float64 [...] each."""
    P = masses.shape[-1]
    gold = torch.zeros(P, dtype=torch.bool)
    gold[list(golden)] = True
    attended = masses > epsilon
    hits = (attended & gold).sum(-1).double()
    n_att = attended.sum(-1).double()
    precision = torch.where(n_att > 0, hits / n_att.clamp_min(1), torch.zeros_like(hits))
    recall = hits / len(golden)
    denom = precision + recall
    f1 = torch.where(denom > 0, 2 * precision * recall / denom.clamp_min(1e-12), torch.zeros_like(denom))
    # Stable sort: equal masses keep prompt order, so ties are resolved the same way every run.
    top = torch.sort(masses, dim=-1, descending=True, stable=True).indices[..., : len(golden)]
    em = gold[top].all(-1).double()
    return f1, em


# --------------------------------------------------------------------------------------------------
# Scoring a data set
# --------------------------------------------------------------------------------------------------


@dataclass
class _Item:
    example: MDQAExample
    ids: list[int]
    spans: list[tuple[int, int]]


def prepare(examples: Sequence[MDQAExample], tokenizer: Any, max_length: int | None) -> list[_Item]:
    """Tokenise every prompt (no answer) and check it before any model work; errors name the example."""
    if not examples:
        raise MDQAError("no MDQA examples to score")
    items = []
    for ex in examples:
        # Records built in code skip the loader: validate them the same way (golden ids among the
        # passages, no empty passage, at least one distractor), naming the example.
        example_from_json(ex.to_json(), f"example {ex.id}")
        pr = build_prompt(ex, tokenizer, include_answer=False, max_length=max_length)
        items.append(_Item(ex, pr.input_ids, pr.passage_spans))
    return items


def _batch(
    items: Sequence[_Item], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids / mask [B, S], last prompt rows int64 [B] and passage index of every key [B, S]."""
    S = max(len(it.ids) for it in items)
    ids = torch.full((len(items), S), pad_id, dtype=torch.long)
    mask = torch.zeros(len(items), S, dtype=torch.long)
    segment = torch.full((len(items), S), -1, dtype=torch.long)
    for b, it in enumerate(items):
        ids[b, : len(it.ids)] = torch.tensor(it.ids)
        mask[b, : len(it.ids)] = 1
        for p, (s, e) in enumerate(it.spans):
            segment[b, s:e] = p
    last = mask.sum(1) - 1
    return ids, mask, last, segment


def _resumed(
    done: Mapping[int, tuple[str, np.ndarray]], items: Sequence[_Item], shape: tuple[int, int]
) -> dict[int, torch.Tensor]:
    """The masses of an interrupted run's examples, each checked against the example it claims to be."""
    out = {}
    for i, (example_id, masses) in done.items():
        want = (*shape, len(items[i].spans)) if i < len(items) else None
        if want is None or example_id != items[i].example.id or masses.shape != want:
            raise MDQAError(
                f"the interrupted run's masses of example {i} ({example_id!r}, shape {list(masses.shape)}) do "
                "not fit this run's data and model (edited progress files?); pass --overwrite to start over"
            )
        out[i] = torch.from_numpy(masses)
    return out


@torch.no_grad()
def score_mdqa(
    model: torch.nn.Module,
    tokenizer: Any,
    examples: Sequence[MDQAExample],
    config: MDQAScoreConfig | None = None,
    progress: bool = True,
    *,
    done: Mapping[int, tuple[str, np.ndarray]] | None = None,
    on_example: Callable[[int, str, np.ndarray], None] | None = None,
) -> MDQAScores:
    """MDQA retrieval scores of every head of ``model`` (on retmask attention) over ``examples``.

    done: example index -> (id, masses float32 [L, Hq, P]) an interrupted run computed (not computed
    again); on_example(index, id, masses): called for every example scored here, after its batch."""
    from tqdm.auto import tqdm

    cfg = config or MDQAScoreConfig()
    cfg.check()
    limit = cfg.max_length if cfg.max_length is not None else max_context(model)
    items = prepare(examples, tokenizer, limit)
    layout = head_layout(model)
    L, Hq = layout.shape
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    per_ex: dict[int, torch.Tensor] = _resumed(done or {}, items, (L, Hq))
    # Longest first: batches of similar lengths waste less padding; results are put back in input order.
    order = sorted((i for i in range(len(items)) if i not in per_ex), key=lambda i: -len(items[i].ids))
    t0 = time.perf_counter()
    bar = tqdm(total=len(items), initial=len(per_ex), desc="mdqa-score", unit="ex", disable=not progress)
    for start in range(0, len(order), cfg.batch_size):
        chunk = order[start : start + cfg.batch_size]
        batch = [items[i] for i in chunk]
        ids, mask, last, segment = _batch(batch, pad_id)
        key_valid = torch.arange(ids.shape[1])[None, :] <= last[:, None]  # causal past of the last row
        P = max(len(it.spans) for it in batch)
        with tap_qk(model, query_rows=last) as tap:
            model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        masses = torch.stack(
            [
                last_row_masses(
                    tap.q[ly][:, :, 0],
                    tap.k[ly],
                    tap.scaling[ly],
                    key_valid.to(device),
                    segment.to(device),
                    P,
                    query_pos=last.to(device),
                    **tap.features[ly],
                )
                for ly in range(L)
            ],
            dim=1,
        ).cpu()  # [B, L, Hq, P]
        tap.clear()
        for b, i in enumerate(chunk):
            per_ex[i] = masses[b, :, :, : len(items[i].spans)]
            if on_example is not None:
                on_example(i, items[i].example.id, per_ex[i].numpy())
        bar.update(len(chunk))
    bar.close()
    seconds = time.perf_counter() - t0
    f1s, ems, gms, pms, ms = [], [], [], [], []
    for i, it in enumerate(items):
        m = per_ex[i]  # [L, Hq, P]
        golden = it.example.golden_indices
        f1, em = f1_em(m, golden, cfg.epsilon)
        f1s.append(f1.numpy())
        ems.append(em.numpy())
        # summed in float64: a float32 sum's order follows the tensor's layout (a slice of a padded batch,
        # or a resumed example's own tensor), which moved the run record's means in the 6th decimal
        gms.append(m[:, :, golden].double().sum(-1).numpy())
        pms.append(m.double().sum(-1).numpy())
        ms.append(m.numpy())
    return MDQAScores(
        example_ids=[it.example.id for it in items],
        f1=np.stack(f1s),
        em=np.stack(ems),
        golden_mass=np.stack(gms),
        passage_mass=np.stack(pms),
        masses=ms,
        config=cfg,
        seconds=seconds,
        prompt_tokens=[len(it.ids) for it in items],
        golden=[list(it.example.golden_indices) for it in items],
        resumed=len(done or {}),
    )


def write_scores(
    scores: MDQAScores,
    out: str | Path,
    plot: str | Path | None = None,
    masses: bool = False,
    **extra: Any,
) -> dict[str, Path]:
    """Write ``out`` (scores JSON), ``<out stem>.run.json`` (record), optionally a heatmap PNG and, with
    ``masses``, ``<out stem>.masses.npz`` (every example's float32 [L, Hq, P] masses and golden indices, to
    re-score at another ε without the model). Every file is written atomically; one the machine refuses (a
    full disk) is an ``OutputWriteError`` naming it, and the files written before it stay."""
    out = Path(out)
    atomic_write_json(out, scores.scores_json())
    record = out.with_name(out.stem + ".run.json")
    atomic_write_json(record, scores.record_json(**extra))
    paths = {"scores": out, "record": record}
    if masses:
        npz = out.with_name(out.stem + ".masses.npz")
        arrays = {f"masses_{i}": m for i, m in enumerate(scores.masses)}
        golden = np.array([",".join(map(str, g)) for g in scores.golden])
        buf = io.BytesIO()  # built in memory, then written like every other output (atomic, errors named)
        np.savez_compressed(buf, example_ids=np.array(scores.example_ids), golden=golden, **arrays)
        atomic_write_bytes(npz, buf.getvalue())
        paths["masses"] = npz
    if plot is not None:
        n = len(scores.example_ids)
        paths["plot"] = head_heatmap(
            scores.mean("f1"),
            plot,
            title=f"MDQA retrieval score (mean F1, ε = {scores.config.epsilon:g}, {n} examples)",
            cbar_label="MDQA retrieval score",
        )
    return paths


def top_heads(scores: MDQAScores, n: int = 10) -> list[tuple[int, int, float, float]]:
    """The n best heads by mean F1: (layer, head, mean F1, mean EM)."""
    f1, em = scores.mean("f1"), scores.mean("em")
    flat = np.argsort(-f1, axis=None, kind="stable")[:n]
    out = []
    for idx in flat:
        ly, h = np.unravel_index(idx, f1.shape)
        out.append((int(ly), int(h), float(f1[ly, h]), float(em[ly, h])))
    return out


# --------------------------------------------------------------------------------------------------
# Answer accuracy (greedy), a cheap check that training did not break the answers
# --------------------------------------------------------------------------------------------------


def _norm(text: str) -> str:
    return " ".join("".join(c.lower() if c.isalnum() else " " for c in text).split())


@torch.no_grad()
def answer_accuracy(
    model: torch.nn.Module,
    tokenizer: Any,
    examples: Sequence[MDQAExample],
    max_new_tokens: int = 12,
    max_length: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Greedy answers to the prompts (the training template up to ``Answer:``); an answer is correct when
    the normalised gold answer occurs in the normalised first line of the output.

    Returns ``{"accuracy": float, "outputs": [{"id", "answer", "output", "correct"}]}``.
    """
    from tqdm.auto import tqdm

    limit = max_length if max_length is not None else max_context(model)
    items = prepare(examples, tokenizer, limit)
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )  # fmt: skip
    rows = []
    for it in tqdm(items, desc="answers", unit="ex", disable=not progress):
        ids = torch.tensor([it.ids], device=device)
        # generate with an in-place KV cache: a long document prompt is not copied at every new token
        gen = generate_copies(model, ids, torch.ones_like(ids), config)
        text = tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
        first = text.strip().split("\n")[0]
        gold = _norm(it.example.answer)
        correct = bool(gold) and f" {gold} " in f" {_norm(first)} "
        rows.append({"id": it.example.id, "answer": it.example.answer, "output": first, "correct": correct})
    return {"accuracy": sum(r["correct"] for r in rows) / len(rows), "outputs": rows}
