"""`/v1/realtime`: the OpenAI Realtime API over a websocket: the socket and
its reader and writer, the session, a response's events, and the protocol's
checked fields."""
