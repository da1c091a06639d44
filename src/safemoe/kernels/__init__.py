"""Triton kernels, one module per stage of the data path: router, dispatch, experts (the two
expert GEMMs) and combine. Imported lazily by the public ops, after safemoe has chosen between
compiled Triton (CUDA) and the Triton interpreter (CPU)."""
