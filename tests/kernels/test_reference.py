"""The oracle itself and the public entry point's argument checking."""

import pytest
import torch

from retmask.kernels import attention, reference_attention

from .helpers import left_padding_mask, make_qkv


def test_reference_matches_naive_loop():
    q, k, v = make_qkv(2, 4, 2, 3, 7, 8, seed=1)
    pad = left_padding_mask(2, 7, [0, 3])
    out, argmax = reference_attention(q, k, v, causal=True, sm_scale=0.3, key_padding_mask=pad, argmax_rows=3)
    for b in range(2):
        for h in range(4):
            for i in range(3):
                pos = 7 - 3 + i
                keys = [j for j in range(7) if j <= pos and pad[b, j]]
                s = torch.stack([q[b, h, i] @ k[b, h // 2, j] * 0.3 for j in keys])
                p = torch.softmax(s, 0)
                expected = sum(p[n] * v[b, h // 2, j] for n, j in enumerate(keys))
                torch.testing.assert_close(out[b, h, i], expected, atol=1e-5, rtol=1e-5)
                assert argmax[b, h, i].item() == keys[int(s.argmax())]


def test_reference_no_valid_key_and_skip():
    q, k, v = make_qkv(1, 2, 1, 4, 4, 8, seed=2)
    pad = left_padding_mask(1, 4, [2])  # rows 0 and 1 (positions 0, 1) see no valid key
    skip = torch.tensor([[False, True]])
    out, argmax = reference_attention(
        q, k, v, causal=True, key_padding_mask=pad, skip_heads=skip, argmax_rows=4
    )
    assert torch.isfinite(out).all()
    assert (out[0, 0, :2] == 0).all() and (argmax[0, 0, :2] == -1).all()
    assert (out[0, 1] == 0).all() and (argmax[0, 1] == -1).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(q=torch.randn(2, 4, 3), k=torch.randn(2, 2, 5, 8), v=torch.randn(2, 2, 5, 8)), "q must have 4"),
        (dict(q=torch.randn(2, 3, 3, 8), k=torch.randn(2, 2, 5, 8), v=torch.randn(2, 2, 5, 8)), "multiple"),
        (dict(q=torch.randn(3, 4, 3, 8), k=torch.randn(2, 2, 5, 8), v=torch.randn(2, 2, 5, 8)), "batch size"),
        (dict(q=torch.randn(2, 4, 3, 8), k=torch.randn(2, 2, 5, 4), v=torch.randn(2, 2, 5, 4)), "head dim"),
        (dict(q=torch.randn(2, 4, 6, 8), k=torch.randn(2, 2, 5, 8), v=torch.randn(2, 2, 5, 8)), "M <= N"),
        (dict(q=torch.randn(2, 4, 3, 8), k=torch.randn(2, 2, 5, 8), v=torch.randn(2, 2, 4, 8)), "same shape"),
        (
            dict(q=torch.randn(2, 4, 3, 8).half(), k=torch.randn(2, 2, 5, 8), v=torch.randn(2, 2, 5, 8)),
            "dtype",
        ),
    ],
)
def test_bad_shapes_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        attention(**kwargs)


def test_bad_masks_raise_value_error():
    q, k, v = make_qkv(2, 4, 2, 3, 5, 8)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \[B, N\] = \[2, 5\]"):
        attention(q, k, v, key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        attention(q, k, v, key_padding_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"skip_heads must have shape \[Hq\] = \[4\]"):
        attention(q, k, v, skip_heads=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="argmax_rows"):
        attention(q, k, v, return_argmax=True, argmax_rows=4)
    for rows in (0, 2):  # given without return_argmax, even a falsy 0, is a mistake worth naming
        with pytest.raises(ValueError, match="argmax_rows was given but return_argmax=False"):
            attention(q, k, v, argmax_rows=rows)
    with pytest.raises(ValueError, match="window must be >= 1"):
        attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
        attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        attention(q, k, v, backend="cuda")
