"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..attention import AttentionCall
from ..cache import Forward, SparseCache
from ..layers import KVLayer
from ..options import check_number
from ..press import Press
from . import h2o_step


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
        ratio: fraction of each prompt's KV kept (heavy + recent), in (0, 1], held while decoding; at least 1
            token. 1.0 evicts nothing.
        budget: tokens kept per sequence (heavy + recent): a shorter prompt is kept whole, and its row grows to
            the budget while decoding before it evicts.
        recent_ratio: share of the budget reserved for the most recent tokens (default 0.5: the paper's even
            heavy / recent split, sec. 5).
        block_size: prompt queries scored at once at prefill (memory vs speed; not part of the method).
    """

    recent_ratio: float = 0.5
    block_size: int = 256
    captures_step_queries: ClassVar[bool] = True  # `after_step` recomputes the step's attention row (sdpa, flash)
    joins_rows: ClassVar[bool] = True  # its scores follow their slots (`extra`)
    compiled_decoding: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        self.recent_ratio = check_number("H2OPress", "recent_ratio", self.recent_ratio, low=0, high=1,
                                         unit="share of the budget")
        self.block_size = check_number("H2OPress", "block_size", self.block_size, integer=True, low=1,
                                       unit="queries")

    def recent_start(self, cache: SparseCache, length: int | torch.Tensor, device: torch.device) -> torch.Tensor:
        """`(batch, 1, 1)` first position of each row's recent window once `length` tokens are seen (an int, or
        a tensor on `device` of a shape that broadcasts, e.g. `(batch, heads, 1)`), on `device` (computed there:
        nothing is copied to it while decoding)."""
        recent = (cache.on("budgets", device).double() * self.recent_ratio).round().long()
        return length - recent[:, None, None]

    def holds_budget_while_decoding(self) -> bool:
        return self.ratio != 1.0  # (1.0 keeps everything, decoding included)

    def begin_forward(self, cache: SparseCache, forward: Forward) -> None:
        h2o_step.plan(self, cache, forward)

    @staticmethod
    def heavy_scores(received: torch.Tensor, positions: torch.Tensor, length: int | torch.Tensor,
                     start: torch.Tensor) -> torch.Tensor:
        """Received attention over the queries that saw each token (`length` tokens seen, an int or a tensor that
        broadcasts: every slot was seen at least once); tokens at or after `start` (the recent window) score +inf,
        always kept. Any leading dimensions: one layer's `(batch, heads, slots)` or every layer's stacked."""
        scores = received / (length - positions)
        return scores.masked_fill_(positions >= start, float("inf"))

    def layer_scores(self, cache: SparseCache, layer: KVLayer) -> torch.Tensor:
        """One layer's scores: the recent window is the step's (planned), or at the prompt the prompt's."""
        plan = cache.forward.plan
        start = h2o_step.recent(self, cache, layer) if plan is not None else \
            self.recent_start(cache, layer.logical_len, layer.device)
        return self.heavy_scores(layer.extra["received"], layer.positions, layer.logical_len, start.to(layer.device))

    def compress(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        budgets = self.row_budgets(cache)
        if not self.holds_budget_while_decoding():  # everything kept, decoding included: nothing to score
            layer.extra.pop("received", None)  # (a prompt read in pieces) as in one forward
            return
        # The prompt's received attention does not depend on the budget: replays of one prompt share it. A prompt
        # kept whole needs it too: its budget is held once decoding grows past it.
        received = cache.prompt_work(("h2o-received", call.module.layer_idx), lambda: self.received(layer, call))
        layer.extra["received"] = received.clone()
        if not self.keeps_everything(cache):
            scores = self.layer_scores(cache, layer).masked_fill(~call.valid()[:, None, :], float("-inf"))
            layer.keep(scores, budgets)

    def received(self, layer: KVLayer, call: AttentionCall) -> torch.Tensor:
        """Attention each prompt token received from all prompt queries, summed per KV head `(b, h_kv, n)`: from
        the call's queries (`call.offset` on), added to what earlier pieces of the prompt gave (`read_piece`)."""
        b, h_kv, n, _ = layer.keys.shape
        if call.weights is not None:  # eager already materialised it; padding queries' rows are dropped
            weights = call.weights.float() * call.valid()[:, None, :, None]
            return weights.view(b, h_kv, -1, n, n).sum(dim=(2, 3))
        earlier = layer.extra.get("received")
        received = torch.zeros(b, h_kv, n, dtype=torch.float32, device=layer.keys.device) if earlier is None \
            else earlier.clone()
        for start in range(call.offset, n, self.block_size):
            end = min(start + self.block_size, n)
            received[..., :end] += call.prefill_probs(layer.keys, start, end).sum(dim=(2, 3))
        return received

    def prompt_tail(self) -> int | None:
        return 0  # every query's attention is read piece by piece (`read_piece`)

    def read_piece(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        """A piece of a prompt read in pieces: the attention its queries gave every token so far, kept with the
        slots (zeros for the next piece's tokens) until `compress` adds the last piece's."""
        layer.extra["received"] = self.received(layer, call)

    def after_step(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        """Algorithm 1 at a decoding step: the attention the step's queries give every slot joins what each
        received, and a row over its budget evicts its lowest-scored tokens. A one-token step on a full cache
        does both for every layer at once, after the last (`h2o_step`)."""
        if self.holds_budget_while_decoding() and not h2o_step.waits(self, cache, layer, call):
            self.add_received(cache, layer, call)
            self.hold_budget(cache, layer, self.layer_scores(cache, layer))
        h2o_step.finish(self, cache, layer)

    def add_received(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        """Add the attention the step's queries gave every slot (summed over each KV head's query heads)."""
        if call.weights is not None:  # eager: (b, heads, q, slots), already masked
            b, h_q, q, n = call.weights.shape
            h_kv = layer.keys.shape[1]
            received = call.weights.float().view(b, h_kv, h_q // h_kv, q, n).sum(dim=(2, 3))
        elif cache.forward.q_len == 1 and layer.all_valid:  # one new token, every slot real: no mask
            received = call.probs(layer.keys, None).sum(dim=(2, 3))
        else:
            new = torch.arange(layer.slots - cache.forward.q_len, layer.slots, device=layer.keys.device)
            visible = layer.valid[:, None, :] & (torch.arange(layer.slots, device=new.device) <= new[:, None])
            received = call.probs(layer.keys, visible).sum(dim=(2, 3))
        layer.extra["received"] += received
