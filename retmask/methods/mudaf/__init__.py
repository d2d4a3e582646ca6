"""MuDAF: multi-document QA retrieval scores of heads, and contrastive training of selected heads.

``mdqa`` (synthetic multi-document QA data and prompts) → ``score`` (per-head MDQA retrieval score from the
last prompt token's attention mass per passage) → ``loss`` / ``train`` (``L_CLM + λ·L_CON`` on the tapped
queries and passage keys of heads sampled by score).
"""
