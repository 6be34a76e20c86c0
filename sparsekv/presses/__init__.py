"""One press per file, each reading like its paper's algorithm."""

from .adakv import AdaKVPress
from .chess import CHESSPress
from .chunkkv import ChunkPress
from .decoding import DecodingPress
from .expected_attention import ExpectedAttentionPress
from .h2o import H2OPress
from .keydiff import KeyDiffPress
from .knorm import KnormPress
from .kvzip import KVzipPress
from .pyramidkv import PyramidKVPress
from .registry import make_press, press_class, registered
from .sentencekv import SentencePress
from .snapkv import SnapKVPress
from .streaming_llm import StreamingLLMPress
from .tova import TOVAPress

ChunkKVPress = ChunkPress  # the papers' names
SentenceKVPress = SentencePress

__all__ = [
    "AdaKVPress", "CHESSPress", "ChunkKVPress", "ChunkPress", "DecodingPress", "ExpectedAttentionPress", "H2OPress",
    "KVzipPress", "KeyDiffPress", "KnormPress", "PyramidKVPress", "SentenceKVPress", "SentencePress", "SnapKVPress",
    "StreamingLLMPress", "TOVAPress", "make_press", "press_class", "registered",
]
