"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..context import Context
from ..options import check_number
from ..press import ScorerPress


@dataclass(kw_only=True)
class SnapKVPress(ScorerPress):
    """Keep the prompt tokens the last `window_size` prompt queries attend to most, plus that window.

    The window's attention is recomputed for the window queries only (w x L, never L x L), summed over the
    window, averaged over the query heads of each KV head's GQA group (so the cache stays at KV-head size),
    and smoothed with a 1-D pool so that kept tokens come with their neighbours. Selection is per KV head.

    Choice where sparsekv departs from the authors' configs: the pooling kernel is 15 tokens, not 7. A max pool
    keeps `kernel_size // 2` tokens on each side of a peak, and the window's attention often peaks on the first
    tokens of a value; 7 then keeps 3 tokens after it, and on real prose SnapKV answered codes with pieces missing
    (`ZJ1-D2P` for `ZJ1-D26P`). `kernel_size=7` gives the paper's configs.

    Args:
        ratio: fraction of each prompt's KV kept, window included, in (0, 1]; at least the window (a prompt no
            longer than it is kept whole).
        budget: tokens kept per prompt, window included (SnapKV's C; at least `window_size`).
        window_size: observation window, in tokens (default 32, SnapKV sec. 4).
        kernel_size: pooling kernel, in tokens, odd (default 15, sparsekv's, see above; the SnapKV LongBench
            configs use 7).
        pooling: "max" or "avg" (default "max", the LongBench configs).
    """

    window_size: int = 32
    kernel_size: int = 15
    pooling: str = "max"
    compiled_decoding: ClassVar[bool] = True  # its steps append only (a compiled cache's free slots)

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        self.window_size = check_number(name, "window_size", self.window_size, integer=True, low=1, unit="tokens")
        self.kernel_size = check_number(name, "kernel_size", self.kernel_size, integer=True, low=1, unit="tokens")
        if self.kernel_size % 2 == 0:
            raise ValueError(f"{name}: kernel_size must be an odd integer >= 1 (a centred pooling window); got "
                             f"{self.kernel_size}.")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"{name}: pooling must be 'max' or 'avg'; got {self.pooling!r}.")
        self.check_floor()

    def min_kept(self) -> tuple[int, str]:
        return self.window_size, f"window_size={self.window_size}"

    def prompt_tail(self) -> int | None:
        return self.window_size  # the window's queries; the keys are in the cache

    def window_scores(self, ctx: Context) -> torch.Tensor:
        """Observation-window attention received by each prompt token, `(batch, kv_heads, prompt)`, pooled.

        Shared with presses that build on SnapKV's scoring (ChunkKV, SentenceKV's prefilter). It depends on
        the prompt and the scoring options only, so replays of one prompt compute it once.
        """
        key = ("snapkv-window", self.window_size, self.kernel_size, self.pooling, ctx.layer_idx)
        return ctx.prompt_work(key, lambda: self._window_scores(ctx))

    def _window_scores(self, ctx: Context) -> torch.Tensor:
        n, w = ctx.keys.shape[-2], self.window_size
        scores = ctx.attention(-w).sum(dim=-2).mean(dim=2)  # the window's queries: (b, h_kv, group, w, n)
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        pad = self.kernel_size // 2
        b, h, _ = scores.shape
        scores = pool(scores.reshape(b * h, 1, n), self.kernel_size, stride=1, padding=pad).reshape(b, h, n)
        scores[..., n - w :] = float("inf")
        return scores

    def score(self, ctx: Context) -> torch.Tensor:
        return self.window_scores(ctx)
