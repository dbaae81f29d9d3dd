"""Persistent, verified KV prompt caches: the KVC3 file (container.py, torch-free) and the store of them."""
