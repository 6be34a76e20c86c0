"""H2O's executor for a one-token decoding step, the algorithm of `sparsekv.presses.h2o` done once for every layer
instead of once per layer: the recent window's start found once (`plan`), the step's attention rows recomputed
with every layer's query rotated in one product (`defer`, `add_deferred`), and every layer's victim found from
their stacked scores after the last layer (`evict_together`). A decoding step's cost where the host is the bound
is its op count, and these ops are tiny: their count is the cost."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention import AttentionCall, attention_probs, query_norm, rotate_projections
from ..buffers import victim_indices
from ..cache import Forward, SparseCache
from ..layers import KVLayer, lowest_real


@dataclass
class Step:
    """One decoding step's plan, shared by the layers of its forward (`forward.plan`).

    Attributes:
        length: tokens seen once this forward's are in, `(batch, heads, 1)`, and `start`, the first position of
            each row's recent window: found by the first layer that needs them (`recent`); None before.
        budget: the largest row budget: a layer holding one slot more evicts one token per row and head.
        last: the forward's last compressed layer, which evicts for the layers waiting in `waiting`.
        budgets: `(batch,)` each row's budget (a row holding fewer real tokens fills a filler slot instead).
        waiting: the layers whose victim is found after the last layer.
        deferred: the layers (and their calls) whose attention row is recomputed after the last layer.
    """

    budget: int
    last: KVLayer
    budgets: torch.Tensor
    length: torch.Tensor | None = None
    start: torch.Tensor | None = None
    waiting: list[KVLayer] = field(default_factory=list)
    deferred: list[tuple[KVLayer, AttentionCall]] = field(default_factory=list)


def plan(press, cache: SparseCache, forward: Forward) -> None:
    """The budget and the layer that evicts for the others, found once for every layer."""
    layers = cache.compressed_layers()
    if cache.budgets is not None and layers:
        forward.plan = Step(cache.largest_budget, layers[-1], cache.on("budgets", layers[0].device))


def recent(press, cache: SparseCache, layer: KVLayer) -> torch.Tensor:
    """The step's recent window start (and `step.length`, the count it is found from), once for every layer (all
    see the same tokens): from the newest token's position, the layer's last slot once the forward's tokens are
    in (so no count of tokens is read on the host, which a compiled step would be traced anew for)."""
    step = cache.forward.plan
    if step.start is None:
        step.length = layer.positions[..., -1:] + 1
        step.start = press.recent_start(cache, step.length, layer.device)
    return step.start


def waits(press, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> bool:
    """A one-token step on a full layer (one victim to find): the layer waits for the last one, and its
    attention row is added now or, where it can be, recomputed after the last layer (`defer`). False: another
    forward (a prompt continued, a draft), which the press scores and evicts at once."""
    step = cache.forward.plan
    if cache.forward.q_len != 1 or layer.slots != step.budget + 1:
        return False
    recent(press, cache, layer)
    step.waiting.append(layer)
    if not defer(step, layer, call, cache.forward):
        press.add_received(cache, layer, call)
    return True


def finish(press, cache: SparseCache, layer: KVLayer) -> None:
    """After the forward's last layer: the deferred attention rows, then every waiting layer's victim."""
    step = cache.forward.plan
    if step is not None and layer is step.last and step.waiting:
        add_deferred(step)
        evict_together(press, step)


def defer(step: Step, layer: KVLayer, call: AttentionCall, forward: Forward) -> bool:
    """Keep a one-token step's query projection for `add_deferred` (its attention row is needed only for the
    victim found after the last layer), when its row needs no mask and its RoPE is the step's shared matrix."""
    if call.weights is not None or call.scaled_rope is None or forward.input_valid is not None or \
            not layer.all_valid or query_norm(call.module) is not None or \
            step.deferred and step.deferred[0][1].scaled_rope is not call.scaled_rope:
        return False
    step.deferred.append((layer, call))
    return True


def add_deferred(step: Step) -> None:
    """The attention rows of the layers `defer` kept: every layer's query rotated and scaled in one product
    with the step's RoPE matrix (three ops a layer before), then each layer's row over its own keys."""
    if not step.deferred:
        return
    layers, calls = zip(*step.deferred)
    module = calls[0].module
    channels = module.config.num_attention_heads * module.head_dim
    queries = rotate_projections([call.projected for call in calls], calls[0].scaled_rope, channels)
    for layer, q in zip(layers, queries.unbind(1)):  # each (b, heads, 1, d)
        layer.extra["received"] += attention_probs(module, q, layer.keys, None).sum(dim=(2, 3))
    step.deferred = []


def evict_together(press, step: Step) -> None:
    """Every waiting layer's victim of this step from their stacked scores: the same few ops once per step
    instead of once per layer. Layers on different devices or holding different slot counts are stacked apart.
    The stacks are copies: each layer keeps its own."""
    groups: dict[tuple, list[KVLayer]] = {}
    for layer in step.waiting:
        groups.setdefault((layer.device, layer.slots), []).append(layer)
    for layers in groups.values():
        positions = torch.stack([layer.positions for layer in layers])
        scores = press.heavy_scores(torch.stack([layer.extra["received"] for layer in layers]), positions,
                                    step.length.to(positions.device), step.start.to(positions.device))
        valid = None if all(layer.all_valid for layer in layers) else torch.stack([layer.valid for layer in layers])
        budgets = None if valid is None else step.budgets.to(positions.device)
        victims = lowest_real(scores, valid, budgets)
        slots, index = victim_indices(victims, layers[0].keys.shape[-1])  # every layer's, in one go
        for layer, victim, slot, idx in zip(layers, victims.unbind(), slots.unbind(), index.unbind()):
            layer.evict(victim, (slot, idx))
    step.waiting = []
