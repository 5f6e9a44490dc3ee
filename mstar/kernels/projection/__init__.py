"""Projections of a decode row: x @ weight.T with the RMSNorm before it and
the SiLU-and-multiply after it fused in (`gemv.py`, on CUDA cores), the
tensor-core form over float8 weights (`gemv_mma.py`), and the blocks both
kernels share (`blocks.py`)."""
