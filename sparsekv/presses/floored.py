"""The base of kvpress's simple scorers: a `ScorerPress` whose floor is a number of tokens, `min_budget`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..options import check_number
from ..press import ScorerPress


@dataclass(kw_only=True)
class FlooredScorerPress(ScorerPress):
    """A scorer that keeps no window of its own (kvpress's Knorm, KeyDiff, TOVA): its floor is `min_budget`.

    Args:
        ratio: fraction of each prompt's KV kept, in (0, 1].
        budget: tokens kept per prompt, at least `min_budget`.
        min_budget: the fewest tokens a row keeps, in tokens (default 64, sparsekv's: kvpress and the papers set
            none; a prompt within it, a chat turn, is kept whole, and a press that evicts while decoding lets the
            row grow to it first).
    """

    min_budget: int = 64
    compiled_decoding: ClassVar[bool] = True  # its steps append, or evict one token into the slot it frees

    def __post_init__(self):
        super().__post_init__()
        self.min_budget = check_number(type(self).__name__, "min_budget", self.min_budget, integer=True, low=1,
                                       unit="tokens")
        self.check_floor()

    def min_kept(self) -> tuple[int, str]:
        return self.min_budget, f"min_budget={self.min_budget}"
