"""HyperSwap: a transparent reverse proxy that shares one GPU between local AI applications."""

__version__ = "0.1.0"
