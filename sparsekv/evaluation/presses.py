"""The presses `sparsekv eval` knows, by name. Later presses register here: `PRESSES["name"] = PressClass`.

"full" (None) is the uncompressed cache, the reference every sweep includes.
"""

from __future__ import annotations

from .. import H2OPress, SnapKVPress, StreamingLLMPress
from ..press import Press

PRESSES: dict[str, type[Press] | None] = {
    "full": None,
    "snapkv": SnapKVPress,
    "h2o": H2OPress,
    "streamingllm": StreamingLLMPress,
}


def make_press(name: str, ratio: float | None = None, budget: int | None = None) -> Press | None:
    """The press `name` keeping `ratio` of the KV (or `budget` tokens); None for "full"."""
    if name not in PRESSES:
        raise ValueError(f"--presses: unknown press {name!r}; known presses: {', '.join(PRESSES)}.")
    cls = PRESSES[name]
    return None if cls is None else cls(ratio=ratio, budget=budget)
