"""CUDA graphs of a component's steps, captured at start-up and replayed by
the worker thread: decode steps of token loop groups (`cuda_graphs`), KV
modes with a signature (`kv_mode_graphs`), mixed steps (`mixed_graphs`),
plain modes (`mode_graphs`) and the decode graphs' draws (`sampler_graphs`).
Each has an eager path beside it that the CPU runs.
"""
