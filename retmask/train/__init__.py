"""Training with RetMask preference pairs: DPO (``dpo.py``), the SFT baseline, pairs-file validation."""
