"""SPIN serving: speculative decoding with a pool of heterogeneous draft models."""

__version__ = "0.1.0"
