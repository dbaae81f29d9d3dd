"""Persistent, verified KV prompt caches: the KVC1 container (torch-free) and, later, the store."""
