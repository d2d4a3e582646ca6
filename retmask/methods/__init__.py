"""Training methods built on retrieval heads: ``retmask`` (mask heads → DPO pairs) and ``mudaf`` (contrastive
attention focusing of selected heads)."""
