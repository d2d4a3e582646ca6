"""A head-sparse KV cache: every key of the retrieval heads, sink + window for the others.

Per global layer the cache keeps ALL tokens for a chosen set of KV heads ("full" heads) and, for the
other KV heads ("windowed"), only the first S tokens (attention sinks) plus the most recent W; evicted
keys are freed. The retmask attention function computes such a layer in two parts (full heads over all
keys, windowed heads over their compact buffer) and scatters the outputs back into head order.

policy.py       which KV heads stay full: ``budget=``, ``tau=`` or an explicit ``full_heads=`` list
layer.py        ``HeadSparseLayer``: one layer's storage (``update`` hands the attention a ``SparseKV``)
sink_window.py  exact attention over an unordered "first S + last W" key set (prefill), O(rows x kept keys)
attention.py    the split attention the retmask attention function calls for a head-sparse layer
cache.py        ``HeadSparseCache`` and the public ``head_sparse_cache(model, ...)``

This ``__init__`` imports nothing: ``retmask.hf.interface`` imports ``attention.py`` (and so this
package) while ``cache.py`` imports ``retmask.hf.patch``, which imports the interface.
"""
