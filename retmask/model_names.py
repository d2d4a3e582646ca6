"""Models retmask knows by a short name (``--model NAME``). No imports: every command's ``--help`` lists
these names (``retmask.commands.common.MODEL_SPEC``) without loading torch; ``retmask.hf.loading`` resolves
them (``named_model_path``)."""

NAMED_MODELS = ("smollm2", "gemma3-270m")
