"""One press per file, each reading like its paper's algorithm."""

from .chess import CHESSPress
from .chunkkv import ChunkPress
from .h2o import H2OPress
from .registry import make_press, press_class, registered
from .sentencekv import SentencePress
from .snapkv import SnapKVPress
from .streaming_llm import StreamingLLMPress

ChunkKVPress = ChunkPress  # the papers' names
SentenceKVPress = SentencePress

__all__ = [
    "CHESSPress", "ChunkKVPress", "ChunkPress", "H2OPress", "SentenceKVPress", "SentencePress", "SnapKVPress",
    "StreamingLLMPress", "make_press", "press_class", "registered",
]
