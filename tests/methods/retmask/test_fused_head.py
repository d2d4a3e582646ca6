"""TRL's fused LM head on a CPU: inside ``labelled_positions_only`` it projects only the labelled positions,
with the same log-probabilities, loss and gradients as TRL's every-position path."""

from __future__ import annotations

import copy

import pytest
import torch

from retmask.methods.retmask.fused_head import labelled_positions_only
from tests.tiny import tiny_llama

VOCAB = 300


@pytest.fixture
def fused_model():
    """A tiny random Llama in train mode, patched with TRL's fused LM head (as DPOTrainer does)."""
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_llama(VOCAB, seed=3, init=0.05).train()
    add_fused_lm_head(model)
    return model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows of 23 tokens: prompt positions and right padding unlabelled (-100), like a DPO batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 23), generator=g)
    attention = torch.ones_like(ids)
    labels = ids.clone()
    for row, (prompt, length) in enumerate([(9, 23), (14, 19), (5, 12)]):
        labels[row, :prompt] = -100
        labels[row, length:] = -100
        attention[row, length:] = 0
    return ids, attention, labels


def projected_rows(model, ids, attention, labels, monkeypatch) -> tuple[list[int], object]:
    """Run the fused head; return the row count of every LM-head projection call and the output."""
    import trl.trainer.utils as trl_utils
    from trl.kernels import ChunkedLogProbFunction as original

    rows: list[int] = []

    class Spy:
        @staticmethod
        def apply(hidden, *args):
            rows.append(hidden.shape[0])
            return original.apply(hidden, *args)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Spy)
    out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    return rows, out


def test_only_labelled_rows_are_projected_with_the_same_values(fused_model, monkeypatch):
    ids, attention, labels = batch()
    labelled = int((labels[:, 1:] != -100).sum())
    twin = copy.deepcopy(fused_model)

    rows_all, out_all = projected_rows(fused_model, ids, attention, labels, monkeypatch)
    with labelled_positions_only() as active:
        rows_few, out_few = projected_rows(twin, ids, attention, labels, monkeypatch)
    assert active is True
    assert rows_all == [ids.shape[0] * (ids.shape[1] - 1)]  # TRL's CPU path: every shifted position
    assert rows_few == [labelled] and labelled < rows_all[0] / 2

    torch.testing.assert_close(out_few.log_probs, out_all.log_probs, rtol=0, atol=1e-5)
    assert bool((out_few.log_probs[labels[:, 1:] == -100] == 0).all())
    assert bool((out_all.log_probs[labels[:, 1:] != -100] != 0).all())
    torch.testing.assert_close(out_few.loss, out_all.loss, rtol=0, atol=1e-6)
    out_all.loss.backward()
    out_few.loss.backward()
    for (name, p_all), p_few in zip(fused_model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p_few.grad, p_all.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_all_changes_nothing_and_the_switch_is_undone(fused_model, monkeypatch):
    import trl.trainer.utils as trl_utils

    ids, attention, labels = batch(1)
    before = trl_utils._use_triton
    with labelled_positions_only("all") as active:
        rows, _ = projected_rows(fused_model, ids, attention, labels, monkeypatch)
    assert active is False and rows == [ids.shape[0] * (ids.shape[1] - 1)]
    with pytest.raises(RuntimeError, match="inside"):
        with labelled_positions_only():
            assert trl_utils._use_triton is not before
            raise RuntimeError("inside")
    assert trl_utils._use_triton is before
    assert before(torch.device("cpu")) is False  # TRL's own predicate: the compact path is off on a CPU


def test_bad_positions_value():
    with pytest.raises(ValueError, match="'labelled', 'all'"):
        with labelled_positions_only("completion"):
            pass


def test_cpu_lm_head_runs_retmask_kernel_with_trl_values_and_gradients(fused_model, monkeypatch):
    """Inside ``cpu_lm_head`` TRL's fused forward computes with ``CPUChunkedLogProb``: same
    log-probabilities, loss and gradients as TRL's kernel (fp32), and the switch is undone."""
    import trl.trainer.utils as trl_utils

    import retmask.cpu_speedups.logprob as lp
    from retmask.methods.retmask.fused_head import cpu_lm_head

    calls: list[int] = []
    original_apply = lp.CPUChunkedLogProb.apply
    monkeypatch.setattr(
        lp.CPUChunkedLogProb, "apply", lambda *a: calls.append(a[0].shape[0]) or original_apply(*a)
    )
    ids, attention, labels = batch(2)
    twin = copy.deepcopy(fused_model)
    before = trl_utils._ChunkedLogProbFunction
    out_trl = fused_model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    with labelled_positions_only(), cpu_lm_head("retmask") as impl:
        out_ours = twin(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    assert impl == "retmask" and calls == [int((labels[:, 1:] != -100).sum())]
    assert trl_utils._ChunkedLogProbFunction is before
    torch.testing.assert_close(out_ours.log_probs, out_trl.log_probs, rtol=0, atol=1e-5)
    out_trl.loss.backward()
    out_ours.loss.backward()
    for (name, p_trl), p_ours in zip(fused_model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p_ours.grad, p_trl.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_cpu_lm_head_choice_and_errors(monkeypatch):
    import trl.trainer.utils as trl_utils

    from retmask.methods.retmask.fused_head import cpu_lm_head, lm_head_impl

    before = trl_utils._ChunkedLogProbFunction
    assert lm_head_impl() == "retmask"
    monkeypatch.setenv("RETMASK_CPU_SPEEDUPS", "0")  # the CPU speed-ups off: TRL's head
    with cpu_lm_head() as impl:
        assert impl == "trl" and trl_utils._ChunkedLogProbFunction is before
    monkeypatch.setenv("RETMASK_CPU_SPEEDUPS", "liger")
    with pytest.raises(ValueError, match="RETMASK_CPU_SPEEDUPS='liger'"):
        lm_head_impl()
    with pytest.raises(ValueError, match="'retmask', 'trl'"):
        with cpu_lm_head("fast"):
            pass
    with pytest.raises(RuntimeError, match="inside"):
        with cpu_lm_head("retmask"):
            assert trl_utils._ChunkedLogProbFunction is not before
            raise RuntimeError("inside")
    assert trl_utils._ChunkedLogProbFunction is before


def test_a_trl_head_with_other_arguments_is_kept(monkeypatch):
    """Another TRL version's head function (other arguments) is not replaced."""
    import trl.trainer.utils as trl_utils

    from retmask.methods.retmask.fused_head import cpu_lm_head

    class OtherHead(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, targets, chunk_size):
            return hidden

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", OtherHead)
    with cpu_lm_head("retmask") as impl:
        assert impl == "trl" and trl_utils._ChunkedLogProbFunction is OtherHead
