"""RetMask: mask the retrieval heads, sample chosen (original) / rejected (masked) responses, train with DPO.

Stages, one module each: ``instructions`` (load prompts) → ``generate`` (chosen/rejected pairs, per-row head
masks on one model copy) → ``pairs`` / ``train_config`` / ``dpo`` (TRL DPO or SFT) with ``telemetry`` (live
retrieval score of masked vs other heads) → ``pipeline`` (all stages in one resumable run directory).
``instruction_data`` writes the shipped instruction set.
"""
