"""Toy models with small random torch modules, for tests of the runtime
against plain PyTorch references."""
