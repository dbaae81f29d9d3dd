"""gguf files: the header read and checked with bounds, the tensors mapped (torch-free)."""
