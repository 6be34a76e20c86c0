"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..attention import AttentionCall
from ..cache import SparseCache
from ..layers import KVLayer
from ..options import check_number
from ..press import Press


@dataclass(kw_only=True)
class StreamingLLMPress(Press):
    """Keep the first `n_sinks` tokens (attention sinks) and the most recent ones: a rolling cache.

    The prompt is cut to sinks + its most recent tokens, and during decoding the oldest non-sink token is
    evicted as each new one arrives, so the cache never holds more than the budget after a step
    (the paper's rolling KV cache, sec. 3.2). Scores depend on position only, so every layer and head holds the
    same positions: a decoding step finds its victim slots once, for all layers.

    Args:
        ratio: fraction of each prompt's KV kept (sinks included), in (0, 1], held while decoding; at least
            `n_sinks` + 1 tokens. 1.0 evicts nothing.
        budget: tokens kept per sequence (sinks included): a shorter prompt is kept whole, and its row grows to
            the budget while decoding before it rolls.
        n_sinks: attention-sink tokens always kept (default 4, paper sec. 3.2).
    """

    n_sinks: int = 4
    joins_rows: ClassVar[bool] = True  # positions are all it reads, and they follow their slots
    compiled_decoding: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        self.n_sinks = check_number("StreamingLLMPress", "n_sinks", self.n_sinks, integer=True, low=0, unit="tokens")
        if self.budget is not None and self.budget <= self.n_sinks:
            raise ValueError(f"StreamingLLMPress: budget={self.budget} must exceed n_sinks={self.n_sinks}.")

    def prompt_tail(self) -> int | None:
        return 0  # positions only

    def holds_budget_while_decoding(self) -> bool:
        return self.ratio != 1.0  # (1.0 keeps everything, decoding included)

    def recency(self, cache: SparseCache, layer: KVLayer) -> torch.Tensor:
        """Newer is higher; sinks (each row's first real tokens) and filler slots are never evicted."""
        start = cache.on("prompt_start", layer.positions.device)[:, None, None]
        sink = layer.positions < start + self.n_sinks
        return layer.positions.float().masked_fill(sink, float("inf"))

    def compress(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        budgets = self.row_budgets(cache, self.n_sinks + 1, f"n_sinks={self.n_sinks} plus 1 recent token")
        if budgets is not None:
            layer.keep(self.recency(cache, layer).masked_fill(~layer.valid[:, None, :], float("-inf")), budgets)

    def after_step(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        """The rolling cache: a row over its budget evicts its oldest non-sink tokens (one at a decoding step)."""
        if self.holds_budget_while_decoding():
            # Every layer and head holds the same positions in the same slots: one victim a step serves them all,
            # scored at the step's first layer.
            self.hold_budget(cache, layer, lambda: self.recency(cache, layer), shared_by_layers=True)
