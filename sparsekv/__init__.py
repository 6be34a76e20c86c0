"""sparsekv: KV-cache compression policies ("presses") for Hugging Face transformers models.

    from sparsekv import SnapKVPress
    with SnapKVPress(ratio=0.1)(model):
        model.generate(...)
"""

from .cache import CacheStats, Forward, KVLayer, SparseCache, StoreLayer
from .press import Press, ScorerPress
from .state import RowState
from .presses import (
    CHESSPress,
    ChunkKVPress,
    ChunkPress,
    H2OPress,
    SentenceKVPress,
    SentencePress,
    SnapKVPress,
    StreamingLLMPress,
    make_press,
    registered,
)

from .pipeline import SparseKVPipeline  # registers pipeline("sparsekv-text-generation")

__version__ = "0.1.0"

__all__ = [
    "CHESSPress",
    "CacheStats",
    "ChunkKVPress",
    "ChunkPress",
    "Forward",
    "H2OPress",
    "KVLayer",
    "Press",
    "RowState",
    "ScorerPress",
    "SentenceKVPress",
    "SentencePress",
    "SnapKVPress",
    "SparseCache",
    "SparseKVPipeline",
    "StoreLayer",
    "StreamingLLMPress",
    "make_press",
    "registered",
]
