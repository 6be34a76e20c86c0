"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", arXiv 2406.02069)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import SparseCache
from ..context import Context
from ..layers import KVLayer
from ..options import check_number
from ..state import RowState
from .snapkv import SnapKVPress


@dataclass
class PyramidState(RowState):
    """Per generation: each compressed layer's rank among them from the bottom (the model's layers that are not
    compressed, sliding-window ones, are not counted)."""

    ranks: dict[int, int]


@dataclass(kw_only=True)
class PyramidKVPress(SnapKVPress):
    """SnapKV's selection under budgets that shrink with depth: more tokens in the lower layers, where attention
    is spread, fewer in the upper ones, where it is focused (the paper's "pyramidal information funneling").

    Each row's budget is the mean over the compressed layers: the top layer keeps `budget / beta` tokens, the
    bottom one `2 x budget - budget / beta`, the layers between an arithmetic sequence (sec. 3.3), so the cache
    holds what `SnapKVPress` would. Where the paper is silent, sparsekv's choices keep that mean: the bottom layer
    keeps at most the row's prompt (the top one then keeps more), and the top layer at least the window, which
    makes the pyramid gentler (the authors' code and kvpress keep uniform budgets then: at 10% of a 4k prompt
    with a 32-token window, that is every row). Tokens are chosen per layer and KV head as `SnapKVPress` chooses
    them.

    Args:
        ratio: fraction of each prompt's KV kept, over the layers, window included, in (0, 1].
        budget: tokens kept per prompt, the mean over the layers, window included (at least `window_size`).
        beta: how steep the pyramid is: the top layer keeps `1 / beta` of the mean budget (default 20, sec. 4).
        window_size: `SnapKVPress`'s observation window, in tokens (default 32, sparsekv's SnapKV; the paper
            attends the last 8 tokens, `window_size=8`).
        kernel_size: `SnapKVPress`'s pooling kernel, in tokens (default 15).
        pooling: `SnapKVPress`'s pooling, "max" or "avg" (default "max").
    """

    beta: float = 20

    def __post_init__(self):
        super().__post_init__()
        self.beta = check_number("PyramidKVPress", "beta", self.beta, low=1, unit="mean budget / top layer's")

    def new_state(self, cache: SparseCache) -> PyramidState:
        compressed = [i for i, layer in enumerate(cache.layers) if isinstance(layer, KVLayer)]
        return PyramidState({i: rank for rank, i in enumerate(compressed)})

    def row_budgets(self, ctx: Context) -> torch.Tensor | None:
        budgets = super().row_budgets(ctx)
        if budgets is None:  # every prompt kept whole
            return None
        lengths = ctx.valid[:, 0].sum(-1)  # each row's prompt tokens (its slots at the prompt)
        ranks = ctx.state.ranks
        return self.layer_budgets(budgets.to(lengths.device), lengths, ranks[ctx.layer_idx], len(ranks))

    def layer_budgets(self, budgets: torch.Tensor, lengths: torch.Tensor, rank: int, layers: int) -> torch.Tensor:
        """Tokens each row keeps `(batch,)` at the `rank`-th of `layers` compressed layers (0: the bottom), for
        rows of `lengths` prompt tokens whose mean budgets over the layers are `budgets`."""
        mean = budgets.double()
        top = (mean / self.beta).clamp(min=self.window_size)  # the window, at least: a gentler pyramid
        bottom = (2 * mean - top).clamp(max=lengths.double())  # the prompt, at most: the top keeps what it leaves
        top = (2 * mean - bottom).clamp(min=self.window_size)
        step = (bottom - top) / max(layers - 1, 1)
        pyramid = (bottom - rank * step).round().long()
        return torch.where(budgets < lengths, pyramid, budgets)  # a row kept whole stays whole
