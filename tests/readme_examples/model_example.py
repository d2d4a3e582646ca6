import retmask
model, tok = retmask.load_model()                    # embedded SmolLM2, attn_implementation="retmask"
with retmask.head_mask(model, [(18, 6), (20, 6)]):   # switch heads off (skipped by the kernel)
    out = model.generate(**tok("Hello", return_tensors="pt"), max_new_tokens=8)
with retmask.capture_argmax(model, rows=4) as cap:   # argmax key of the last 4 rows, every layer/head
    model(**tok("The cat sat on the mat", return_tensors="pt"))
cap.last.shape                                       # int64 [L, B, Hq, 4]
cache = retmask.growing_cache(model)                 # KV cache appended in place (no copy per token)
out = model.generate(**tok("Hello", return_tensors="pt"), max_new_tokens=64, cache=cache)
