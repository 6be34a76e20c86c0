"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..context import Context
from ..options import check_number
from ..press import ScorerPress


@dataclass(kw_only=True)
class StreamingLLMPress(ScorerPress):
    """Keep the first `n_sinks` tokens (attention sinks) and the most recent ones: a rolling cache.

    The prompt is cut to sinks + its most recent tokens, and during decoding the oldest non-sink token is
    evicted as each new one arrives, so the cache never holds more than the budget after a step
    (the paper's rolling KV cache, sec. 3.2). Scores depend on position only, so every layer and head holds the
    same positions: a decoding step finds its victim slots once, for all layers.

    A row never holds fewer than the sinks and a recent window of `window_size` tokens (the floor): a ratio's
    budget is raised to it, so a prompt and its answer that fit in it (a chat turn of a few dozen tokens) are never
    evicted, and the output is the model's own. The paper's caches are sinks and a recent window of hundreds of
    tokens and more, and it sets no floor for short prompts: sparsekv's choice, small enough that a ratio still
    compresses prompts of a few hundred tokens.

    Args:
        ratio: fraction of each prompt's KV kept (sinks included), in (0, 1], held while decoding; at least
            `n_sinks + window_size` tokens. 1.0 evicts nothing.
        budget: tokens kept per sequence (sinks included), at least `n_sinks + window_size`: a shorter prompt is
            kept whole, and its row grows to the budget while decoding before it rolls.
        n_sinks: attention-sink tokens always kept (default 4, paper sec. 3.2).
        window_size: the most recent tokens always kept, in tokens (default 60, sparsekv's: with the sinks, a
            floor of 64 tokens, under which a chat turn and its answer decode untouched); the window is the budget
            less the sinks when that is larger.
    """

    n_sinks: int = 4
    window_size: int = 60
    compiled_decoding: ClassVar[bool] = True
    # Every layer and head holds the same positions in the same slots: one victim a step serves them all, scored
    # at the step's first layer.
    scores_by_position: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        self.n_sinks = check_number("StreamingLLMPress", "n_sinks", self.n_sinks, integer=True, low=0, unit="tokens")
        self.window_size = check_number("StreamingLLMPress", "window_size", self.window_size, integer=True, low=1,
                                        unit="recent tokens always kept")
        self.check_floor()

    def min_kept(self) -> tuple[int, str]:
        """The floor: the sinks and the recent window."""
        return self.n_sinks + self.window_size, f"n_sinks={self.n_sinks} + window_size={self.window_size}"

    def prompt_tail(self) -> int | None:
        return 0  # positions only

    def score(self, ctx: Context) -> torch.Tensor:
        """Newer is higher; sinks (each row's first real tokens) are always kept."""
        sink = ctx.positions < ctx.prompt_start[:, None, None] + self.n_sinks
        return ctx.positions.float().masked_fill(sink, float("inf"))

    def score_step(self, ctx: Context) -> torch.Tensor:
        """The rolling cache: a row over its budget evicts its oldest non-sink token (one a decoding step)."""
        return self.score(ctx)
