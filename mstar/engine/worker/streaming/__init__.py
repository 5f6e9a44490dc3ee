"""Walk streams on the worker thread: a producer's writes into the buffer of
the consumer partition that reads them (`edges.py`, `buffer.py`), and the
link that carries them to consumers on other workers (`peer_link.py`)."""
