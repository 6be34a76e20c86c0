"""sparsekv: KV-cache compression policies ("presses") for Hugging Face transformers models.

    from sparsekv import SnapKVPress
    with SnapKVPress(ratio=0.1)(model):
        model.generate(...)
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from .cache import CacheStats, Forward, KVLayer, SparseCache, StoreLayer
from .pipeline import SparseKVPipeline  # registers pipeline("sparsekv-text-generation")
from .prefill import prefill_rows
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
    make_press,
    registered,
)
from .state import RowState

try:
    __version__ = _version("sparsekv")  # pyproject.toml is the one place the version is written
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

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
    "prefill_rows",
    "registered",
]
