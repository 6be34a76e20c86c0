"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..attention import AttentionCall
from ..cache import Forward, KVLayer, SparseCache
from ..press import Press, check_number


@dataclass(kw_only=True)
class H2OPress(Press):
    """Keep heavy hitters (tokens that received the most attention) and the most recent tokens.

    Scores are the attention each token has received, accumulated over every query so far (all prompt
    queries, then every decoding step) and divided by the number of queries that could see it, so early tokens
    are not favoured for being old. The cache is cut to the budget at prefill and one token is evicted at every
    decoding step, so it never holds more than the budget after a step (paper sec. 4, Algorithm 1).

    The prompt's attention is recomputed in blocks of `block_size` queries (never an L x L matrix); decoding
    uses the step's attention weights (eager) or recomputes the one query's row (sdpa, flash).

    Args:
        ratio: fraction of each prompt's KV kept (heavy + recent), in (0, 1].
        budget: tokens kept per sequence (heavy + recent).
        recent_ratio: share of the budget reserved for the most recent tokens (default 0.5: the paper's even
            heavy / recent split, sec. 5).
        block_size: prompt queries scored at once at prefill (memory vs speed; not part of the method).
    """

    recent_ratio: float = 0.5
    block_size: int = 256
    reads_step_queries: ClassVar[bool] = True  # `after_step` recomputes the step's attention row (sdpa, flash)

    def __post_init__(self):
        super().__post_init__()
        self.recent_ratio = check_number("H2OPress", "recent_ratio", self.recent_ratio, low=0, high=1,
                                         unit="share of the budget")
        self.block_size = check_number("H2OPress", "block_size", self.block_size, integer=True, low=1,
                                       unit="queries")

    def recent_start(self, cache: SparseCache, length: int) -> torch.Tensor:
        """`(batch, 1, 1)` first position of each row's recent window once `length` tokens are seen."""
        recent = (cache.budgets.double() * self.recent_ratio).round().long()
        return (length - recent)[:, None, None]

    def begin_forward(self, cache: SparseCache, forward: Forward) -> None:
        """A decoding step: every layer's recent window, found once (all layers see the same tokens)."""
        layers = cache.compressed_layers()
        if cache.budgets is not None and layers:
            start = self.recent_start(cache, layers[0].logical_len + forward.q_len)
            forward.plan = start.to(layers[0].device)

    def heavy_scores(self, cache: SparseCache, layer: KVLayer) -> torch.Tensor:
        """Normalised received attention; the row's most recent tokens score +inf (always kept)."""
        scores = layer.extra["received"] / (layer.logical_len - layer.positions)  # every slot was seen: >= 1
        start = cache.forward.plan
        if start is None:  # the prompt: no step plan
            start = self.recent_start(cache, layer.logical_len).to(scores.device)
        return scores.masked_fill_(layer.positions >= start, float("inf"))

    def compress(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        budgets = self.row_budgets(cache)
        if self.keeps_everything(cache):
            return
        # The prompt's received attention does not depend on the budget: replays of one prompt share it.
        received = cache.prompt_work(("h2o-received", call.module.layer_idx), lambda: self.received(layer, call))
        layer.extra["received"] = received.clone()
        scores = self.heavy_scores(cache, layer).masked_fill(~call.valid()[:, None, :], float("-inf"))
        layer.keep(scores, budgets)

    def received(self, layer: KVLayer, call: AttentionCall) -> torch.Tensor:
        """Attention each prompt token received from all prompt queries, summed per KV head `(b, h_kv, n)`."""
        b, h_kv, n, _ = layer.keys.shape
        if call.weights is not None:  # eager already materialised it; padding queries' rows are dropped
            weights = call.weights.float() * call.valid()[:, None, :, None]
            return weights.view(b, h_kv, -1, n, n).sum(dim=(2, 3))
        received = torch.zeros(b, h_kv, n, dtype=torch.float32, device=layer.keys.device)
        for start in range(0, n, self.block_size):
            end = min(start + self.block_size, n)
            received[..., :end] += call.prefill_probs(layer.keys, start, end).sum(dim=(2, 3))
        return received

    def after_step(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        if not layer.compressed:
            return
        if call.weights is not None:  # eager: (b, heads, q, slots), already masked
            b, h_q, q, n = call.weights.shape
            h_kv = layer.keys.shape[1]
            received = call.weights.float().view(b, h_kv, h_q // h_kv, q, n).sum(dim=(2, 3))
        elif call.q_len == 1 and layer.all_valid:  # one new token, every slot real: it sees them all, no mask
            received = call.probs(layer.keys, None).sum(dim=(2, 3))
        else:
            new = torch.arange(layer.slots - call.q_len, layer.slots, device=layer.keys.device)
            visible = layer.valid[:, None, :] & (torch.arange(layer.slots, device=new.device) <= new[:, None])
            received = call.probs(layer.keys, visible).sum(dim=(2, 3))
        layer.extra["received"] += received
        self.hold_budget(cache, layer, self.heavy_scores(cache, layer))

