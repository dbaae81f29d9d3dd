"""The transformers backend: the only package of lm-worker that imports torch or transformers.

- ``backend``: the backend (load, tokenize, render, generate and prefill on transformers models);
- ``hf_compat``: every difference between transformers versions, and the attention the worker
  registers with transformers;
- ``decode_step``, ``fast_weights``, ``exact_attention`` (and its C source): the fast decode step,
  quantized weights, float32 attention of fixed summation order (the next token is chosen by
  ``worker.sampling``, in numpy);
- ``torch_adapter``: a model's cache as the tensors a KVC2 file holds, and back;
- ``torch_threads``: torch's threads on the worker's threads other than the model's;
- ``shipped``: the models shipped as gguf files in PyPI packages, and their one-time conversion;
- ``tiny_model``: the tiny offline test models.

Nothing here is imported until the backend is used (``capabilities`` answers before torch loads).
"""
