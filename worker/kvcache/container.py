"""KVC3, the file of a persistent KV prompt cache: what the rest of the worker uses of it. Torch-free.

The format is split by job, each module behind the names here:

- format.py: the layout's constants, the header's Structs and the errors of reading a file;
- validate.py: whether a header is sound, and of the model reading it (``check_identity``,
  ``layout_problem``);
- write.py: an atomic ``write`` through a locked temporary, and ``remove_stale_temporaries``;
- read.py: ``read_header`` and ``load``, every byte verified (KVC2 read as well, KVC1 only
  recognised);
- memory.py: the memory a file is read into, and the process-wide ``reserve`` for restores.

Nothing here unpickles anything.
"""

from __future__ import annotations

from worker.kvcache.format import (
    ALIGNMENT, CHECKSUMS, FORMAT, MAGIC, CacheFormatError, CacheMissing, Contents, Header, Identity,
    IdentityMismatch, LayerEntry, LayerKind, OldHeader, OutdatedCache, StateEntry, TensorEntry, TensorKind, TensorSpec,
    UnsupportedCache, cut_point,
)
from worker.kvcache.memory import reserve
from worker.kvcache.read import LoadedCache, load, read_header
from worker.kvcache.validate import check_identity, layout_problem
from worker.kvcache.write import remove_stale_temporaries, write

__all__ = [
    "ALIGNMENT", "CHECKSUMS", "FORMAT", "MAGIC", "CacheFormatError", "CacheMissing", "Contents", "Header", "Identity",
    "IdentityMismatch", "LayerEntry", "LayerKind", "LoadedCache", "OldHeader", "OutdatedCache", "StateEntry",
    "TensorEntry", "TensorKind", "TensorSpec", "UnsupportedCache", "check_identity", "cut_point", "layout_problem",
    "load", "read_header", "remove_stale_temporaries", "reserve", "write",
]
