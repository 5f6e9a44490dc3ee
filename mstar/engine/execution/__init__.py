"""What a worker runs for a step: the components built on the device, the
runner (prepare inputs, forward, sample), the sampler, and CUDA graphs. Runs
on the worker thread; reads the rows it runs, never the worker's loop."""
