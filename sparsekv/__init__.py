"""sparsekv: KV-cache compression policies ("presses") for Hugging Face transformers models.

    from sparsekv import SnapKVPress
    with SnapKVPress(ratio=0.1)(model):
        model.generate(...)

The names below are imported when first used (`import sparsekv` loads neither torch nor transformers, so the
command line starts fast), and `pipeline("sparsekv-text-generation")` is registered with transformers' pipelines
as soon as they are imported, before or after sparsekv (`sparsekv.pipeline`).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING

from ._pipeline_task import register_when_pipelines_load

try:
    __version__ = _version("sparsekv")  # pyproject.toml is the one place the version is written
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# Public name -> the module that defines it.
_WHERE = {
    "CacheStats": ".stats", "Context": ".context", "Forward": ".forward", "KVLayer": ".layers", "SparseCache": ".cache",
    "StoreLayer": ".store", "SparseKVPipeline": ".pipeline", "prefill_rows": ".prefill", "Press": ".press",
    "ScorerPress": ".press", "RowState": ".state", "CHESSPress": ".presses", "ChunkKVPress": ".presses",
    "ChunkPress": ".presses", "H2OPress": ".presses", "SentenceKVPress": ".presses", "SentencePress": ".presses",
    "SnapKVPress": ".presses", "StreamingLLMPress": ".presses", "KnormPress": ".presses", "KeyDiffPress": ".presses",
    "TOVAPress": ".presses", "AdaKVPress": ".presses", "ExpectedAttentionPress": ".presses",
    "PyramidKVPress": ".presses", "KVzipPress": ".presses",
    "DecodingPress": ".presses", "make_press": ".presses", "registered": ".presses",
    "compile_config": ".generation",
}
__all__ = sorted(_WHERE)

register_when_pipelines_load()


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'sparsekv' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value  # once: later reads find it without this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


if TYPE_CHECKING:  # what type checkers and editors see
    from .cache import SparseCache
    from .context import Context
    from .forward import Forward
    from .generation import compile_config
    from .layers import KVLayer
    from .pipeline import SparseKVPipeline
    from .prefill import prefill_rows
    from .press import Press, ScorerPress
    from .presses import (
        AdaKVPress,
        CHESSPress,
        ChunkKVPress,
        ChunkPress,
        DecodingPress,
        ExpectedAttentionPress,
        H2OPress,
        KeyDiffPress,
        KnormPress,
        KVzipPress,
        PyramidKVPress,
        SentenceKVPress,
        SentencePress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
        make_press,
        registered,
    )
    from .state import RowState
    from .stats import CacheStats
    from .store import StoreLayer
