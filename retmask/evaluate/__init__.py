"""Evaluations of a model's long-context retrieval, with or without masked heads.

niah.py       Needle-in-a-Haystack accuracy grid (ROUGE-1 recall per length × depth), heatmap
ablate.py     top-K retrieval heads masked vs K random heads
single_heads.py  each listed head masked alone against no mask (is a head safe to remove?)
shift.py      retrieval-score probe: mean score of a head set vs the other heads
synthetic.py  generated long-context tasks (multi-needle recall, key–value retrieval)
suite.py      `retmask eval`: before/after comparison of models (per-model cache)
kv_budget.py  `retmask kv`: accuracy vs KV memory, retrieval vs random KV heads kept whole (head-sparse cache)
report.py     its markdown report and PNGs
"""
