"""Decode groups, on the worker thread: rows of one token loop stepping
together as tensors (`loop_group.py`), what a group step reads and keeps
(`group_shape.py`), and the CUDA stream each component's groups run on
(`group_stream.py`)."""
