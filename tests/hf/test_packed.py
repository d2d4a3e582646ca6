"""Packed sequences (padding-free batches) on retmask attention: several sequences in one batch row, marked
by position_ids that restart at 0 (transformers then masks each sequence off from the others) or by
flash-attention's cu_seq_lens_q/k. Logits and gradients equal eager attention on the same packed input
and each sequence run on its own; per-row head masks apply to every sequence of their row; what cannot
be laid out per sequence (argmax capture, q/k taps, inconsistent sequence ends) is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

import retmask
from retmask.hf.interface import retmask_attention
from retmask.hf.packed import PackedLayout

from ..device import TEST_DEVICE
from .conftest import VOCAB, tiny_model, with_attn
from .test_attention_features import FEATURE_ARCHS, feature_model

LENGTHS = [7, 1, 3, 9]  # a one-token sequence too; the window of the feature models is 5


def _packed(lengths: list[int], rows: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and position_ids [rows, sum(lengths)]: the same sequence lengths in every row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(rows, -1)
    return ids.to(TEST_DEVICE), positions.to(TEST_DEVICE)


def _model(arch: str):
    return tiny_model("llama") if arch == "llama" else feature_model(arch)


@pytest.mark.parametrize("arch", ["llama", *sorted(FEATURE_ARCHS)])
def test_packed_logits_equal_eager_and_each_sequence_alone(arch):
    model = _model(arch)
    eager = with_attn(model, "eager")
    ids, positions = _packed(LENGTHS, rows=2)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        want = eager(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = torch.cat(
            [model(input_ids=part, use_cache=False).logits for part in ids.split(LENGTHS, 1)], 1
        )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if arch != "gpt_oss":  # its eager forward differs packed and alone too: outside attention
        torch.testing.assert_close(got, alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3_text"])
def test_packed_gradients_equal_eager(arch):
    model = _model(arch)
    eager = with_attn(model, "eager")
    ids, positions = _packed(LENGTHS)
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor(LENGTHS), 0)[:-1]] = -100  # no sequence predicts the next one's start
    for m in (model, eager):
        m.train()
        m.zero_grad()
        m(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=2e-4, rtol=2e-3, msg=name)


@pytest.mark.parametrize("flash_kwargs, with_positions", [(False, True), (True, True), (True, False)])
def test_flattening_collator_batches_equal_each_sequence_alone(flash_kwargs, with_positions):
    """transformers' DataCollatorWithFlattening: position_ids, or cu_seq_lens_q/k (flash-attention's
    variable-length arguments), or both, mark the sequences; without position_ids only cu_seq_lens does
    (the rotary positions then run on across sequences, which changes no q.k product within one). Its
    seq_idx (for the Mamba layers of hybrids) raises no unknown-argument warning."""
    import warnings

    from retmask.hf.interface import UnknownAttentionArgumentWarning

    model = feature_model("gemma2")
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_seq_idx=flash_kwargs)
    batch = collator([{"input_ids": s} for s in sequences])
    batch.pop("labels")
    if not with_positions:
        batch.pop("position_ids")
    batch = {k: v.to(TEST_DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UnknownAttentionArgumentWarning)
        got = model(**batch, use_cache=False).logits
        alone = torch.cat(
            [model(input_ids=torch.tensor([s], device=TEST_DEVICE)).logits for s in sequences], 1
        )
    torch.testing.assert_close(got, alone, atol=1e-4, rtol=1e-4)


def test_per_row_head_mask_applies_to_every_sequence_of_its_row():
    model = tiny_model("llama")
    ids, positions = _packed(LENGTHS, rows=2, seed=4)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    mask = torch.zeros(2, layers, heads, dtype=torch.bool)
    mask[0, 0, 1] = mask[1, 1, 2] = mask[1, 0, 3] = True
    with torch.no_grad():
        with retmask.head_mask(model, mask.to(TEST_DEVICE)):
            got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        for row in range(2):
            with retmask.head_mask(model, mask[row].to(TEST_DEVICE)):
                alone = [
                    model(input_ids=part, use_cache=False).logits
                    for part in ids[row : row + 1].split(LENGTHS, 1)
                ]
            torch.testing.assert_close(got[row : row + 1], torch.cat(alone, 1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layout_moves_every_token_to_its_sequence_row_and_back(seed):
    g = torch.Generator().manual_seed(seed)
    rows, length = 3, 17
    starts = torch.rand(rows, length, generator=g) < 0.3  # a new sequence at ~30% of the tokens
    segment_ids = starts.long().cumsum(1)  # row starts need not be marked: the layout cuts there itself
    layout = PackedLayout.from_segment_ids(segment_ids)
    x = torch.randn(rows, 2, length, 5, generator=g)
    rows_of_sequences = layout.unpack(x)  # [S, 2, L, 5]
    seen = 0
    for row in range(rows):
        for sid in segment_ids[row].unique_consecutive():
            tokens = (segment_ids[row] == sid).nonzero().squeeze(1)
            n = tokens.numel()
            torch.testing.assert_close(rows_of_sequences[seen, :, :n], x[row, :, tokens], rtol=0, atol=0)
            assert layout.valid[seen, :n].all() and not layout.valid[seen, n:].any()
            assert layout.segment_row[seen] == row
            seen += 1
    assert seen == layout.segments and layout.longest == int(layout.valid.sum(1).max())
    back = layout.pack(torch.full_like(rows_of_sequences, float("nan")).copy_(rows_of_sequences))
    torch.testing.assert_close(back, x.transpose(1, 2), rtol=0, atol=0)


def test_a_row_of_one_sequence_is_not_joined_to_the_next_row():
    """transformers numbers each row's sequences from 0: a row holding one sequence (all 0) followed by a
    row that starts with sequence 0 must still give two sequences, not one across the rows."""
    layout = PackedLayout.from_segment_ids(torch.tensor([[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]]))
    assert layout.segments == 3 and layout.valid.sum(1).tolist() == [5, 2, 3]
    assert layout.segment_row.tolist() == [0, 1, 1]


def test_rows_packed_differently_equal_each_sequence_alone():
    model = tiny_model("llama")
    ids, _ = _packed([20], rows=2, seed=5)
    positions = torch.stack([torch.arange(20), torch.cat([torch.arange(n) for n in LENGTHS])]).to(TEST_DEVICE)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        first = model(input_ids=ids[:1], use_cache=False).logits
        second = torch.cat(
            [model(input_ids=part, use_cache=False).logits for part in ids[1:].split(LENGTHS, 1)], 1
        )
    torch.testing.assert_close(got, torch.cat([first, second]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_mask_function_gives_each_sequence_its_own_keys(causal):
    """The mask transformers builds for packed position_ids (here by hand, as masking_utils composes it):
    causal or bidirectional attention within each sequence. Bidirectional rows would see the padding of
    shorter sequences if the padded keys were not masked."""
    from transformers.masking_utils import (
        and_masks,
        bidirectional_mask_function,
        causal_mask_function,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
        remap_positions_for_packed_sequence,
    )  # fmt: skip

    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    base = causal_mask_function if causal else bidirectional_mask_function
    mask_function = and_masks(
        remap_positions_for_packed_sequence(base, positions),
        packed_sequence_mask_function(find_packed_sequence_indices(positions)),
    )
    mask = retmask.hf.retmask_mask(1, 20, 20, mask_function=mask_function, device=torch.device("cpu"))
    got, (module, q, k, v) = _attention_call(attention_mask=mask, is_causal=causal)
    start = 0
    for n in LENGTHS:
        part = [t[:, :, start : start + n] for t in (q, k, v)]
        want = retmask_attention(module, *part, None, is_causal=causal)[0]
        torch.testing.assert_close(got[:, start : start + n], want, rtol=0, atol=1e-6)
        start += n


def test_cumulative_lengths_give_the_segment_ids_layout():
    cu = torch.tensor([0, 7, 8, 11, 20], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    segment_ids = (positions == 0).long().cumsum(0)[None] - 1
    a, b = PackedLayout.from_cumulative_lengths(cu, 20), PackedLayout.from_segment_ids(segment_ids)
    assert a.same_sequences(b) and a.segments == 4 and a.longest == 9


def test_argmax_capture_and_taps_are_refused_on_a_packed_forward():
    model = tiny_model("llama")
    ids, positions = _packed(LENGTHS)
    with torch.no_grad():
        with pytest.raises(
            ValueError, match="capture_argmax records rows and keys per batch row.*padded batch"
        ):
            with retmask.capture_argmax(model, rows=1):
                model(input_ids=ids, position_ids=positions, use_cache=False)
        with pytest.raises(ValueError, match="tap_qk records rows and keys per batch row"):
            with retmask.tap_qk(model):
                model(input_ids=ids, position_ids=positions, use_cache=False)
        # an unpacked forward under the same capture still works
        with retmask.capture_argmax(model, rows=1) as cap:
            model(input_ids=ids, use_cache=False)
    assert len(cap.calls) == 1


def _attention_call(**kwargs):
    module = retmask.hf.head_layout(tiny_model("llama")).layers[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 20, 16, generator=g) for n in (4, 2, 2))
    mask = kwargs.pop("attention_mask", None)
    return retmask_attention(module, q, k, v, mask, **kwargs)[0], (module, q, k, v)


def test_cu_seq_lens_call_equals_each_sequence_alone():
    cu = torch.tensor([0, 7, 8, 11, 20], dtype=torch.int32)
    got, (module, q, k, v) = _attention_call(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone())
    ends = cu.tolist()
    for start, end in zip(ends[:-1], ends[1:], strict=True):
        part = [t[:, :, start:end] for t in (q, k, v)]
        torch.testing.assert_close(
            got[:, start:end], retmask_attention(module, *part, None)[0], rtol=0, atol=1e-6
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cu_seq_lens_q=torch.tensor([0, 6, 20])), "pass both, equal, or neither"),
        (dict(cu_seq_lens_q=torch.tensor([0, 6, 20]), cu_seq_lens_k=torch.tensor([0, 5, 20])), "pass both"),
        (dict(cu_seq_lens_q=torch.tensor([0, 6, 19]), cu_seq_lens_k=torch.tensor([0, 6, 19])), "end at the row"),
        (dict(cu_seq_lens_q=torch.tensor([0, 9, 6, 20]), cu_seq_lens_k=torch.tensor([0, 9, 6, 20])), "rise"),
        (
            dict(
                cu_seq_lens_q=torch.tensor([0, 6, 20]), cu_seq_lens_k=torch.tensor([0, 6, 20]),
                attention_mask=torch.arange(20)[None] >= 2,
            ),
            "with padding in the attention_mask",
        ),
    ],
)  # fmt: skip
def test_inconsistent_sequence_ends_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _attention_call(**kwargs)


def test_cu_seq_lens_that_disagree_with_position_ids_are_refused():
    model = tiny_model("llama")
    ids, positions = _packed(LENGTHS)
    cu = torch.tensor([0, 7, 9, 11, 20], dtype=torch.int32, device=TEST_DEVICE)
    with torch.no_grad(), pytest.raises(ValueError, match="marks other sequences than position_ids"):
        model(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=False)


def test_trl_padding_free_sft_trains_as_eager_does(tmp_path):
    """TRL's SFTTrainer(padding_free=True) packs each batch into one row: a training step on retmask
    attention changes the weights as the same step on eager attention does."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from .conftest import tiny_config

    tokenizer = AutoTokenizer.from_pretrained(retmask.default_model_path())
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tiny")
    rows = [
        {"prompt": "Name a colour.", "completion": " Blue is a colour."},
        {"prompt": "What is two plus two? Answer briefly.", "completion": " Four."},
        {"prompt": "Say hello.", "completion": " Hello there, how are you today?"},
    ]
    weights = {}
    for attn in ("retmask", "eager"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", attn_implementation=attn)
        args = SFTConfig(
            output_dir=str(tmp_path / attn), use_cpu=True, bf16=False, per_device_train_batch_size=3, max_steps=1,
            learning_rate=1.0, optim="sgd", save_strategy="no", report_to=[], padding_free=True, max_length=None, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
        )
        trainer.train()
        weights[attn] = {k: v.detach().clone() for k, v in model.named_parameters()}
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny").state_dict()
    assert not torch.equal(
        weights["retmask"]["model.layers.0.self_attn.q_proj.weight"],
        start["model.layers.0.self_attn.q_proj.weight"],
    )
    for name, value in weights["eager"].items():
        torch.testing.assert_close(weights["retmask"][name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_cu_seq_lens_under_torch_compile_are_refused(monkeypatch):
    """Their layout is a host read of the sequence ends, which a traced graph cannot make."""
    from retmask.hf.interface import _varlen_layout

    module = retmask.hf.head_layout(tiny_model("llama")).layers[0]
    cu = torch.tensor([0, 7, 20])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(NotImplementedError, match="cu_seq_lens.*under torch.compile; run them eagerly"):
        _varlen_layout(module, None, None, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu), 1, 20)
