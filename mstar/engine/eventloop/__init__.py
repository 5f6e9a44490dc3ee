"""The event loop's side of the engine (besides `engine.py`, its public API):
each request's client-facing state and output stream, the workers' step
reports read into it, the requests running on each worker (what routing
reads), the waiting line, and the metrics. Runs on the asyncio thread only;
hears from the workers through `engine/messages.py`."""
