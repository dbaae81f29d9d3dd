"""lm-worker: a long-lived JSON-RPC worker that runs language models for a host process."""

__version__ = "0.1.0"
