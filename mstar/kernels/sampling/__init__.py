"""The sampler's kernels: Exp(1) noise from (seed, counter, index)
(`noise.py`), the top-k / top-p / min-p race over a row sorted in registers
(`race.py`), a whole draw in one launch (`draw.py`; `wide_draw.py` past a
row in registers), and the repetition penalty in one pass (`penalty.py`)."""
