"""The device worker: the one thread per device that runs the scheduler's
step plans and advances requests. Its loop, the executor of the plans, the
walk cursor of each request, streams between partitions, turns, stops,
decode groups, swapping preempted rows, and the link to the other workers.
Runs on that device's worker thread only."""
