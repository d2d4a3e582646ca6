"""The CPU backend: the fused C++ kernel and its Python side (``backend``), its backward (``backward``)
and the blocked-torch path for builds without the extension (``blocked``). Which one a call takes:
``retmask.kernels.paths``."""
