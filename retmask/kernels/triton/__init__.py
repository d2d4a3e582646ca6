"""The Triton backend for CUDA tensors: ``backend`` dispatches to the prefill / chunk forward (``fwd``),
the split-key decode (``decode``) and the backward (``bwd``); ``common`` holds their host-side helpers
and tile tables; ``aot`` compiles them for a GPU target without one (``python -m
retmask.kernels.triton.aot``)."""
