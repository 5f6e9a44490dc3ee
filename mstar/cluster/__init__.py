"""Serving beyond one process: several mstar replicas behind one address
(`front.py`)."""
