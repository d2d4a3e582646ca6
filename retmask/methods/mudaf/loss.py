"""MuDAF's losses: the contrastive loss on tapped q / k and the CLM loss.

Contrastive loss of one example, selected heads H = [(layer, head), ...]:

  q   = concat_{(l,h) in H} Q_t^{l,h}                 Q_t: post-RoPE query of the last prompt token [D]
  k_p = concat_{(l,h) in H} mean_{t' in P_p} K_{t'}^{l, h // G}   mean-pooled post-RoPE keys of passage p
  s_p = cos(q, k_p) / τ                              (G = Hq / Hkv: a query head reads its KV group's keys)
  L_CON = -log softmax(s)[golden]

"concat" is MuDAF's published implementation choice (all selected heads' vectors concatenated before one
cosine similarity; reported more stable); "per-head" is one cross-entropy per head, summed:
-sum_h log softmax_h, and is offered for comparison.

Two golden passages (bridge / comparison questions): MuDAF's published training samples have one golden
passage each against the negatives, so each golden passage g contributes its own term with the *other* golden
passages left out of the softmax (they are not negatives), and the terms are averaged:
  L_CON = mean_g -log( e^{s_g} / (e^{s_g} + sum_{p not golden} e^{s_p}) ).
With one golden passage this is the plain cross-entropy above.

The last prompt token (the ``:`` of ``Answer:``) is the row whose attention MDQA retrieval scores read; its
query and the passages' keys are taken from the same forward pass as the CLM loss, in context, i.e. exactly
the quantities the MDQA retrieval score reads (the reference code instead re-encodes the question and each
passage in separate short passes). Nothing is detached: the loss reaches q_proj / k_proj of the selected heads
(and, through the residual stream, every layer below the deepest selected one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from retmask.heads import Head
from retmask.hf.taps import QKTap
from retmask.methods.mudaf.config import SIMILARITIES


def _contrastive_logits_terms(logits: torch.Tensor, golden: Sequence[int]) -> torch.Tensor:
    """logits: [..., P] similarity / τ -> mean over golden g of -log softmax over {g} ∪ negatives, [...]."""
    P = logits.shape[-1]
    is_gold = torch.zeros(P, dtype=torch.bool, device=logits.device)
    is_gold[list(golden)] = True
    terms = []
    for g in golden:
        keep = ~is_gold
        keep[g] = True  # this golden passage against the negatives only
        masked = logits.masked_fill(~keep, float("-inf"))
        terms.append(-(logits[..., g] - torch.logsumexp(masked, dim=-1)))
    return torch.stack(terms).mean(0)


def contrastive_loss(
    tap: QKTap,
    heads: Sequence[Head],
    passage_spans: Sequence[Sequence[tuple[int, int]]],
    golden: Sequence[Sequence[int]],
    temperature: float = 0.05,
    similarity: str = "concat",
) -> torch.Tensor:
    """L_CON averaged over the batch (scalar, differentiable).

    tap: recorded with ``query_rows`` = each batch row's last prompt token, so ``tap.q[l]`` is
        [B, Hq, 1, D] and ``tap.k[l]`` [B, Hkv, N, D] for every layer l of ``heads``.
    passage_spans: per batch row, the token spans [start, end) of its passages (prompt order).
    golden: per batch row, the indices of its golden passages.
    """
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
    if not heads:
        raise ValueError("contrastive loss needs at least one selected head")
    missing = sorted({ly for ly, _ in heads} - set(tap.q))
    if missing:
        raise RuntimeError(
            f"layers {missing} were not tapped in this forward call; tap every layer of `heads`"
        )
    G = tap.num_kv_groups
    losses = []
    for b, (spans, gold) in enumerate(zip(passage_spans, golden, strict=True)):
        qs = torch.stack([tap.q[ly][b, h, -1] for ly, h in heads])  # [H, D]
        ks = torch.stack(
            [torch.stack([tap.k[ly][b, h // G, s:e].mean(0) for s, e in spans]) for ly, h in heads]
        )  # [H, P, D]
        if similarity == "concat":
            q = qs.reshape(-1)  # [H*D]
            k = ks.transpose(0, 1).reshape(len(spans), -1)  # [P, H*D]
            logits = F.cosine_similarity(q[None], k, dim=-1) / temperature  # [P]
            losses.append(_contrastive_logits_terms(logits, gold))
        else:
            logits = F.cosine_similarity(qs[:, None], ks, dim=-1) / temperature  # [H, P]
            losses.append(_contrastive_logits_terms(logits, gold).sum())
    return torch.stack(losses).mean()


def combine(
    clm: torch.Tensor, con: torch.Tensor | None, lambda_con: float, alpha: float | None
) -> torch.Tensor:
    """Total loss: ``L_CLM + λ·L_CON``, or ``(1-α)·L_CLM + α·L_CON`` when ``alpha`` is set (the
    reference code's form). ``con`` None or weight 0 -> the CLM loss itself (vanilla SFT)."""
    if alpha is not None:
        return clm if con is None or alpha == 0 else (1 - alpha) * clm + alpha * con
    return clm if con is None or lambda_con == 0 else clm + lambda_con * con
