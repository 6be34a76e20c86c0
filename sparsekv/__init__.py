"""sparsekv: KV-cache compression policies ("presses") for Hugging Face transformers models.

    from sparsekv import SnapKVPress
    with SnapKVPress(ratio=0.1)(model):
        model.generate(...)
"""

from .cache import CacheStats, KVLayer, SparseCache
from .press import Press, ScorerPress
from .presses import (
    CHESSPress,
    ChunkKVPress,
    ChunkPress,
    H2OPress,
    SentenceKVPress,
    SentencePress,
    SnapKVPress,
    StreamingLLMPress,
)

from .pipeline import SparseKVPipeline  # registers pipeline("sparsekv-text-generation")

__version__ = "0.1.0"

__all__ = [
    "CHESSPress",
    "CacheStats",
    "ChunkKVPress",
    "ChunkPress",
    "H2OPress",
    "KVLayer",
    "Press",
    "ScorerPress",
    "SentenceKVPress",
    "SentencePress",
    "SnapKVPress",
    "SparseCache",
    "SparseKVPipeline",
    "StreamingLLMPress",
]
