"""The sampler's kernels: Exp(1) noise from (seed, counter, index)
(`noise.py`), the top-k / top-p / min-p race over a row sorted in registers
(`race.py`), and a whole draw in one launch (`draw.py`)."""
