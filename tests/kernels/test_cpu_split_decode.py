"""The C++ kernel's split-key decode: a one-row call whose keys span more than one piece (256 keys,
rounded up to whole key blocks) runs each (batch, kv head) as several pieces and merges their partial
states. Checked against the reference on poisoned buffers, with the cases a merge can get wrong: rows
whose pieces are all padding, ties across pieces, NaN / +inf logits in one piece, windows, soft-capping
and sinks, cuts that are not multiples of the key block; and the promise that the cuts depend on the
call's keys only (same bits whatever the batch, the threads or the other heads' mask)."""

from __future__ import annotations

import pytest
import torch

from retmask.kernels import reference_attention
from retmask.kernels.cpu import backend as cpu_backend

from .helpers import POISON_FLOAT, POISON_INDEX, assert_argmax_matches, left_padding_mask, make_qkv


def decode(q, k, v, *, pad=None, skip=None, block_n=64, dtype_out=None, **features):
    """cpp_forward on NaN / POISON_INDEX-filled buffers -> (out [B, Hq, 1, D], argmax [B, Hq, 1])."""
    B, Hq, _, D = q.shape
    out = torch.full((B, Hq, 1, D), POISON_FLOAT, dtype=q.dtype)
    argmax = torch.full((B, Hq, 1), POISON_INDEX, dtype=torch.int64)
    cpu_backend.cpp_forward(
        q, k, v, causal=True, sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip, argmax_rows=1,
        out=out, argmax=argmax, block_n=block_n, **features,
    )  # fmt: skip
    return out, argmax


# (B, Hq, Hkv, N, D, block_n, window, pads, softcap, sinks)
CASES = [
    (2, 9, 3, 1000, 64, 64, None, [0, 700], None, False),  # SmolLM2 heads; row 1's first pieces all padding
    (1, 4, 1, 1300, 256, 96, None, None, None, False),  # Gemma-3 heads; cuts every 288 keys (3 blocks of 96)
    (2, 8, 2, 777, 32, 32, 300, [0, 500], 5.0, True),  # window starting mid-piece, padding, cap and sinks
    (1, 2, 2, 257, 16, 64, None, None, None, False),  # the last piece holds one key
    (3, 6, 2, 4100, 128, 64, 4000, [0, 3, 4090], None, True),  # long: 17 pieces; a row with 10 valid keys
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_Hq{}_Hkv{}_N{}_D{}_bn{}_w{}".format(*c[:7]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode_matches_reference(case, dtype):
    B, Hq, Hkv, N, D, block_n, window, pads, softcap, with_sinks = case
    q, k, v = make_qkv(B, Hq, Hkv, 1, N, D, dtype=dtype, seed=N + D)
    pad = left_padding_mask(B, N, pads) if pads else None
    skip = torch.zeros(B, Hq, dtype=torch.bool)
    skip[0, : Hq // Hkv] = True  # a whole kv group of row 0: no pieces at all
    skip[-1, -1] = True  # one head of a working group
    features = dict(window=window, softcap=softcap)
    features["sinks"] = torch.randn(Hq, generator=torch.Generator().manual_seed(1)) if with_sinks else None
    out, argmax = decode(q, k, v, pad=pad, skip=skip, block_n=block_n, **features)
    ref, _ = reference_attention(
        q.double(), k.double(), v.double(), sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip,
        window=window, softcap=softcap, sinks=None if features["sinks"] is None else features["sinks"].double(),
    )  # fmt: skip
    assert not out.isnan().any(), "an unwritten element (the buffer was NaN)"
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert (out[skip] == 0).all() and (argmax[skip] == -1).all()
    assert_argmax_matches(
        argmax, q.float(), k.float(), causal=True, sm_scale=D**-0.5, key_padding_mask=pad, skip_heads=skip,
        atol=1e-4, window=window, softcap=softcap,
    )  # fmt: skip


def test_split_decode_ties_and_non_finite():
    """A key duplicated in three pieces is found at its first valid copy; a NaN key poisons exactly the rows of
    its kv head (NaN everywhere, argmax -1), and +inf in a query row only that row; a NaN key inside the
    padding poisons nothing."""
    B, Hq, Hkv, N, D = 2, 4, 2, 1000, 64
    q, k, v = make_qkv(B, Hq, Hkv, 1, N, D, seed=5)
    k[:, 0, 300] = k[:, 0, 5]
    k[:, 0, 900] = k[:, 0, 5]
    q[:, :2, 0] = 4.0 * k[:, 0, 5][:, None, :]  # kv group 0 looks for key 5 (bit-identical copies)
    k[0, 1, 600, 7] = float("nan")  # row 0, kv head 1, in the third piece
    k[1, 1, 100, 0] = float("nan")  # row 1: inside its padding
    q[1, 3, 0, 0] = float("inf")
    pad = left_padding_mask(B, N, [0, 200])
    out, argmax = decode(q, k, v, pad=pad)
    # the first copy each row may see: key 5, or key 300 where 5 is padding
    assert argmax[:, :2, 0].tolist() == [[5, 5], [300, 300]] and not out[:, :2].isnan().any()
    assert out[0, 2:].isnan().all() and (argmax[0, 2:] == -1).all()
    assert out[1, 3].isnan().all() and argmax[1, 3, 0] == -1
    assert not out[1, 2].isnan().any() and argmax[1, 2, 0] >= 200
    ref, _ = reference_attention(q[1:, 2:3], k[1:, 1:], v[1:, 1:], key_padding_mask=pad[1:], sm_scale=D**-0.5)
    torch.testing.assert_close(out[1:, 2:3], ref, atol=2e-5, rtol=2e-5)


def test_split_decode_bits_do_not_depend_on_batch_threads_or_mask():
    """The cuts depend on the call's keys only: a row computed in a batch of three, on one thread or two,
    with other heads switched off, gives the same bits as the row alone."""
    B, Hq, Hkv, N, D = 3, 9, 3, 2000, 64
    q, k, v = make_qkv(B, Hq, Hkv, 1, N, D, seed=9)
    batched, batched_argmax = decode(q, k, v)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for b in range(B):
                alone, alone_argmax = decode(q[b : b + 1], k[b : b + 1], v[b : b + 1])
                assert torch.equal(alone, batched[b : b + 1]) and torch.equal(
                    alone_argmax, batched_argmax[b : b + 1]
                )
    finally:
        torch.set_num_threads(threads)
    skip = torch.zeros(B, Hq, dtype=torch.bool)
    skip[:, :3] = True  # kv group 0 off
    skip[:, 4] = True  # one head of group 1
    masked, masked_argmax = decode(q, k, v, skip=skip)
    assert torch.equal(masked[~skip], batched[~skip]) and torch.equal(
        masked_argmax[~skip], batched_argmax[~skip]
    )
