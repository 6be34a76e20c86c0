"""One press per file, each reading like its paper's algorithm."""

from .h2o import H2OPress
from .snapkv import SnapKVPress
from .streaming_llm import StreamingLLMPress

__all__ = ["H2OPress", "SnapKVPress", "StreamingLLMPress"]
