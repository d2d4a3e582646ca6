"""On the embedded SmolLM2-135M-Instruct (30 layers, 9 query heads over 3 KV heads): the tapped
per-passage masses of every head equal those of eager attention matrices."""

from __future__ import annotations

import copy

import numpy as np
import torch

import retmask
from retmask.methods.mudaf.mdqa import build_prompt, generate_mdqa
from retmask.methods.mudaf.score import score_mdqa


def test_embedded_masses_equal_eager():
    model, tok = retmask.load_model()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ex = generate_mdqa(1, seed=11, num_distractors=7)[0]
    scores = score_mdqa(model, tok, [ex], progress=False)
    pr = build_prompt(ex, tok, include_answer=False)
    with torch.no_grad():
        att = eager(
            input_ids=torch.tensor([pr.input_ids]), output_attentions=True, use_cache=False
        ).attentions
    last = torch.stack([a[0, :, -1] for a in att])  # [30, 9, N]
    ref = torch.stack([last[:, :, s:e].sum(-1) for s, e in pr.passage_spans], dim=-1)
    assert scores.masses[0].shape == (30, 9, len(ex.passages))
    np.testing.assert_allclose(scores.masses[0], ref.numpy(), atol=1e-4)
    assert scores.passage_mass.max() > 0.3  # some heads read the passages from the answer position
