import torch

import retmask
from retmask.niah import build_tests, default_haystack_text, load_needles

model, tok = retmask.load_model()
test = build_tests(tok, load_needles()[1:2], default_haystack_text(), lengths=[3000], depths=[50])[0]
cache = retmask.head_sparse_cache(model, scores="runs/detect/smollm2.json", budget=0.1,  # 10% of KV heads
                                  window=256, sink_tokens=4)  # the others: the first 4 and last 256 tokens
ids = torch.as_tensor(test.prompt_ids)[None]
out = model.generate(ids, max_new_tokens=32, cache=cache)
answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
held = cache.memory_bytes() / cache.full_cache_bytes()  # the share of the full cache's memory it holds
