"""KV-cache formats: float casts, llama.cpp block types, KVarN, transformers' QuantizedCache backends.

    from kvarn.formats import get_format
    fmt = get_format("q4_0", role="k")      # rot=True by default, as llama.cpp
    y = fmt.roundtrip(x)                     # float32 [..., n_tokens, head_dim]
    fmt.nbytes(n_tokens, head_dim)
"""

from . import blocks, floats, kvarn_type  # noqa: F401  (each registers its formats)
from . import ecosystem  # noqa: F401, I001  (last: the registry keeps kvarn.vocab.facts' order)
from .base import KVFormat, Packed
from .registry import get_format, names

__all__ = ["KVFormat", "Packed", "get_format", "names"]
