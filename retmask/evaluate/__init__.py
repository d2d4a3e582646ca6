"""Evaluations of a model's long-context retrieval, with or without masked heads.

niah.py       Needle-in-a-Haystack accuracy grid (ROUGE-1 recall per length × depth), heatmap
ablate.py     top-K retrieval heads masked vs K random heads (Wu et al. Fig. 7)
synthetic.py  generated long-context tasks (multi-needle recall, key–value retrieval)
suite.py      `retmask eval`: before/after comparison of models, markdown report + PNGs
mdqa_score.py multi-document QA retrieval scores of heads (MuDAF)
"""
