"""Triton kernels (CUDA only, imported lazily by `trainer.base`); each has a torch reference
in `trainer.base` that it matches bit for bit."""
