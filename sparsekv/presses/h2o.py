"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..attention import AttentionCall, attention_probs, query_norm, rotate_projections
from ..buffers import victim_indices
from ..cache import Forward, KVLayer, SparseCache
from ..options import check_number
from ..press import Press


@dataclass(kw_only=True)
class H2OPress(Press):
    """Keep heavy hitters (tokens that received the most attention) and the most recent tokens.

    Scores are the attention each token has received, accumulated over every query so far (all prompt
    queries, then every decoding step) and divided by the number of queries that could see it, so early tokens
    are not favoured for being old. The cache is cut to the budget at prefill and one token is evicted at every
    decoding step, so it never holds more than the budget after a step (paper sec. 4, Algorithm 1).

    The prompt's attention is recomputed in blocks of `block_size` queries (never an L x L matrix); decoding
    uses the step's attention weights (eager) or recomputes the one query's row (sdpa, flash), and finds every
    layer's victim at once, after the last layer; there too the rows are recomputed, every layer's query rotated
    in one product (`add_deferred`).

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

    def __post_init__(self):
        super().__post_init__()
        self.recent_ratio = check_number("H2OPress", "recent_ratio", self.recent_ratio, low=0, high=1,
                                         unit="share of the budget")
        self.block_size = check_number("H2OPress", "block_size", self.block_size, integer=True, low=1,
                                       unit="queries")

    def recent_start(self, cache: SparseCache, length: int, device: torch.device) -> torch.Tensor:
        """`(batch, 1, 1)` first position of each row's recent window once `length` tokens are seen, on `device`
        (computed there: nothing is copied to it while decoding)."""
        recent = (cache.on("budgets", device).double() * self.recent_ratio).round().long()
        return (length - recent)[:, None, None]

    def begin_forward(self, cache: SparseCache, forward: Forward) -> None:
        """A decoding step: the recent window's start and the budget, found once for every layer (all layers see
        the same tokens), and the list of layers whose eviction waits for the last one (`after_step`)."""
        layers = cache.compressed_layers()
        if cache.budgets is not None and layers:
            start = self.recent_start(cache, layers[0].logical_len + forward.q_len, layers[0].device)
            forward.plan = _Step(start, cache.largest_budget, layers[-1], cache.on("budgets", layers[0].device))

    @staticmethod
    def heavy_scores(received: torch.Tensor, positions: torch.Tensor, length: int,
                     start: torch.Tensor) -> torch.Tensor:
        """Received attention over the queries that saw each token (`length` tokens seen: every slot was seen at
        least once); tokens at or after `start` (the recent window) score +inf, always kept. Any leading
        dimensions: one layer's `(batch, heads, slots)` or every layer's stacked."""
        scores = received / (length - positions)
        return scores.masked_fill_(positions >= start, float("inf"))

    def layer_scores(self, cache: SparseCache, layer: KVLayer) -> torch.Tensor:
        """One layer's scores: the recent window is the step's (planned), or at the prompt the prompt's."""
        plan = cache.forward.plan
        start = plan.start if plan is not None else self.recent_start(cache, layer.logical_len, layer.device)
        return self.heavy_scores(layer.extra["received"], layer.positions, layer.logical_len, start.to(layer.device))

    def compress(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        budgets = self.row_budgets(cache)
        if self.ratio == 1.0:  # everything kept, decoding included: nothing to score
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
        plan = cache.forward.plan
        if self.ratio != 1.0:  # (ratio=1.0 keeps everything)
            if cache.forward.q_len == 1 and layer.slots == plan.budget + 1:
                plan.waiting.append(layer)  # one victim to find: with the other layers', at the last layer
                if not self._defer(plan, layer, call, cache.forward):
                    self.add_received(cache, layer, call)
            else:
                self.add_received(cache, layer, call)
                self.hold_budget(cache, layer, self.layer_scores(cache, layer))
        if layer is plan.last and plan.waiting:
            self.add_deferred(plan)
            self.evict_together(plan)

    @staticmethod
    def _defer(plan: _Step, layer: KVLayer, call: AttentionCall, forward: Forward) -> bool:
        """Keep a one-token step's query projection for `add_deferred` (its attention row is needed only for the
        victim found after the last layer), when its row needs no mask and its RoPE is the step's shared matrix."""
        if call.weights is not None or call.scaled_rope is None or forward.input_valid is not None or \
                not layer.all_valid or query_norm(call.module) is not None or \
                plan.deferred and plan.deferred[0][1].scaled_rope is not call.scaled_rope:
            return False
        plan.deferred.append((layer, call))
        return True

    def add_deferred(self, plan: _Step) -> None:
        """The attention rows of the layers `_defer` kept: every layer's query rotated and scaled in one product
        with the step's RoPE matrix (three ops a layer before), then each layer's row over its own keys."""
        if not plan.deferred:
            return
        layers, calls = zip(*plan.deferred)
        module = calls[0].module
        channels = module.config.num_attention_heads * module.head_dim
        queries = rotate_projections([call.projected for call in calls], calls[0].scaled_rope, channels)
        for layer, q in zip(layers, queries.unbind(1)):  # each (b, heads, 1, d)
            layer.extra["received"] += attention_probs(module, q, layer.keys, None).sum(dim=(2, 3))
        plan.deferred = []

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

    def evict_together(self, plan: _Step) -> None:
        """Every waiting layer's victim of this step from their stacked scores: the same few ops once per step
        instead of once per layer (their sizes are tiny, their count is the cost). Layers on different devices
        or holding different slot counts are stacked apart. The stacks are copies: each layer keeps its own."""
        groups: dict[tuple, list[KVLayer]] = {}
        for layer in plan.waiting:
            groups.setdefault((layer.device, layer.slots), []).append(layer)
        for layers in groups.values():
            positions = torch.stack([layer.positions for layer in layers])
            scores = self.heavy_scores(torch.stack([layer.extra["received"] for layer in layers]), positions,
                                       layers[0].logical_len, plan.start.to(positions.device))
            valid = None if all(layer.all_valid for layer in layers) else torch.stack([layer.valid for layer in layers])
            budgets = None if valid is None else plan.budgets.to(positions.device)
            victims = self.lowest_real(scores, valid, budgets)
            slots, index = victim_indices(victims, layers[0].keys.shape[-1])  # every layer's, in one go
            for layer, victim, slot, idx in zip(layers, victims.unbind(), slots.unbind(), index.unbind()):
                layer.evict(victim, (slot, idx))
        plan.waiting = []


@dataclass
class _Step:
    """One decoding step's plan, shared by the layers of its forward.

    Attributes:
        start: `(batch, 1, 1)` first position of each row's recent window.
        budget: the largest row budget: a layer holding one slot more evicts one token per row and head.
        last: the forward's last compressed layer, which evicts for the layers waiting in `waiting`.
        budgets: `(batch,)` each row's budget (a row holding fewer real tokens fills a filler slot instead).
    """

    start: torch.Tensor
    budget: int
    last: KVLayer
    budgets: torch.Tensor
    waiting: list[KVLayer] = field(default_factory=list)
    deferred: list[tuple[KVLayer, AttentionCall]] = field(default_factory=list)  # rows for `add_deferred`
