"""Hugging Face transformers integration: attention interface, head masks, argmax capture, patching."""
