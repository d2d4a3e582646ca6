import torch
from retmask.kernels import attention

q, k, v = torch.randn(1, 9, 128, 64), torch.randn(1, 3, 128, 64), torch.randn(1, 3, 128, 64)
pad = torch.ones(1, 128, dtype=torch.bool)            # True = a valid key
skip = torch.zeros(9, dtype=torch.bool)
skip[4] = True                                        # head 4 disabled: output 0, argmax -1, no work
out, argmax = attention(q, k, v, causal=True, key_padding_mask=pad, skip_heads=skip,
                        return_argmax=True, argmax_rows=16)
# q: [B, Hq, M, D]; k, v: [B, Hkv, N, D] (GQA, not repeated); out: [B, Hq, M, D]
# argmax: int64 [B, Hq, 16], the key of the largest logit of each of the last 16 rows (ties: smallest)
