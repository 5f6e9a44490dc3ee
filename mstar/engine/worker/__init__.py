"""The device worker: the one thread per device that schedules, runs and
advances requests. Its loop, the walk cursor of each request, streams
between partitions, turns, stops, decode groups, preemption, and the link
to the other workers. Runs on that device's worker thread only."""
