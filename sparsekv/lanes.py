"""Head-wise budgets held without padding: a layer's kept prompt in lanes.

When the KV heads of a layer keep different numbers of tokens (AdaKV's head-wise budgets, KVzip's global ones), a
slot table per KV head is as wide as the layer's widest head, and the others fill it with filler slots: memory for
the widest head times the heads, not for the budget. Once the prompt is in, the core moves such a layer's tokens
into *lanes* (`pack`): rows of one fixed capacity, each lane belonging to one KV head, a head taking as many as its
tokens fill. A layer then holds its budget, plus less than one lane per head (`LANES_PER_HEAD`), and the tokens that
come after the prompt in its own slot table, as any layer (every head gets each of them).

Attention reads both in one softmax per query head (`attention.lane_attention`): each lane's logits against the
queries of its head's group, the slot table's as usual, their maxima and sums combined per head (a scatter over
the lanes), so that no step copies the cache or pads a head. It runs inside sparsekv's attention implementation
(`attention.sparsekv_implementation`), which the hooks hand the layer's lanes to; the cost over a padded table:
the same logits (fewer: no filler), a dozen more small ops per layer and step (a compiled step fuses them).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from .state import RowState

# A head's tokens span this many lanes on average: a head's last lane is partly filled, so the lanes hold at most
# 1/16 more than the tokens kept (and the batch's rows, the most lanes any row needs).
LANES_PER_HEAD = 16


@dataclass
class Lanes(RowState):
    """A layer's kept prompt, per row in `lanes` rows of `capacity` slots.

    Attributes:
        keys, values: `(batch, lanes, capacity, head_dim)`, rotated, as a `KVLayer`'s.
        positions: `(batch, lanes, capacity)` each slot's absolute position.
        valid: `(batch, lanes, capacity)` False for a slot that holds no token (a head's last lane's rest, or a
            lane no head of the row needs).
        head: `(batch, lanes)` the KV head each lane belongs to.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    head: torch.Tensor

    def counts(self, heads: int) -> torch.Tensor:
        """`(batch, heads)` tokens each head holds."""
        per_lane = self.valid.sum(-1)
        return per_lane.new_zeros(self.head.shape[0], heads).scatter_add_(1, self.head, per_lane)

    def table(self, heads: int, names: tuple[str, ...] = ("keys", "values", "positions", "valid")
              ) -> dict[str, torch.Tensor]:
        """The lanes as a slot table per KV head, `(batch, heads, widest, ...)`, a head holding fewer than the
        widest with filler slots first (as `KVLayer.keep` lays them out): the tensors `names`."""
        b, n_lanes, cap = self.valid.shape
        counts = self.counts(heads)
        width = int(counts.max()) if counts.numel() else 0
        onehot = self.head[..., None] == torch.arange(heads, device=self.head.device)  # (b, lanes, heads)
        lane_rank = (onehot.cumsum(1) - 1).gather(-1, self.head[..., None])[..., 0]  # lane's index in its head
        slot_rank = self.valid.long().cumsum(-1) - 1 + (lane_rank * cap)[..., None]  # (lanes fill in order)
        start = (width - counts).gather(1, self.head)[..., None]  # fillers first
        target = self.head[..., None] * (width + 1) + torch.where(self.valid, start + slot_rank, width)
        return {name: scattered(getattr(self, name), target, heads * (width + 1))
                .unflatten(1, (heads, width + 1))[:, :, :width] for name in names}


def pack(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> Lanes:
    """A layer's slot table (`(batch, heads, slots, ...)`, its real slots `valid`) as lanes: each head's real
    tokens, in slot order, fill `ceil(count / capacity)` lanes of the capacity that gives the widest row
    `LANES_PER_HEAD` lanes per head on average."""
    b, h, s = valid.shape
    counts = valid.sum(-1)  # (b, h)
    cap = max(1, math.ceil(int(counts.sum(-1).max()) / (h * LANES_PER_HEAD)))
    lanes_of = (counts + cap - 1) // cap
    first_lane = lanes_of.cumsum(-1) - lanes_of  # (b, h)
    n_lanes = max(1, int(lanes_of.sum(-1).max()))
    rank = valid.long().cumsum(-1) - 1  # each real slot's index among its head's
    dump = n_lanes * cap  # where slots that hold no token go (dropped)
    target = torch.where(valid, (first_lane[..., None] + rank // cap) * cap + rank % cap, dump)

    lane = torch.arange(n_lanes, device=valid.device)
    head = ((first_lane[:, None, :] <= lane[None, :, None]).sum(-1) - 1).clamp(min=0)  # (b, lanes)
    return Lanes(*(scattered(t, target, dump + 1)[:, :dump].unflatten(1, (n_lanes, cap))
                   for t in (keys, values, positions, valid)), head)


def scattered(t: torch.Tensor, target: torch.Tensor, size: int) -> torch.Tensor:
    """`t` `(batch, a, b, ...)`: each of its `a x b` slots written at its `target` `(batch, a, b)` index among
    `size` slots `(batch, size, ...)`, the others zero (False for validity): how `pack` and `Lanes.table` move
    slots between a table per head and lanes."""
    b, rest = t.shape[0], t.shape[3:]
    out = t.new_zeros((b, size, *rest))
    index = target.reshape(b, -1, *([1] * len(rest))).expand(b, -1, *rest)
    return out.scatter_(1, index, t.flatten(1, 2))


def pack_layers(cache) -> None:
    """Once a prompt is in, move each compressed layer of `cache` whose heads hold different numbers of tokens
    into lanes (`pack_layer`), where its press does nothing over the layer's slots while decoding (its step
    scores, attention, queries or selections would miss the lanes: such a layer keeps its padded table). The
    model's attention must read them: the cache asks this only where a press's block runs it in sparsekv's
    implementation (`attention.reads_lanes`)."""
    press = cache.press
    if press.scores_steps or press.reads_step_attention or press.captures_step_queries \
            or press.selects_before_attention:
        return
    for layer in cache.compressed_layers():
        pack_layer(layer)


def pack_layer(layer) -> None:
    """Move a `KVLayer`'s slots into lanes (`pack`), its own slot table left empty for the tokens after the
    prompt: a layer whose heads hold different numbers of tokens (head-wise budgets), with no per-slot data of a
    press (`extra`), which nothing will score again (the core asks: `SparseCache.end_forward`, and
    `KVLayer.joined` for rows that were in lanes)."""
    if layer.lanes is not None or layer.heads_agree or layer.extra or not layer.slots:
        return
    layer.replace_tensors({})  # (its own tensors, not step views)
    layer.lanes = pack(layer.keys, layer.values, layer.positions, layer.valid)
    layer.replace_tensors({name: t[:, :, :0].clone() for name, t in (("keys", layer.keys), ("values", layer.values),
                                                              ("positions", layer.positions),
                                                              ("valid", layer.valid))})
    layer.heads_agree = layer.all_valid = True


def unpack_layer(layer) -> None:
    """Lanes back into the layer's slot table, before its own slots (what a layer joined with others, or kept
    again, works on)."""
    if layer.lanes is None:
        return
    layer.settle()
    layer.replace_tensors({})
    table, layer.lanes = layer.lanes.table(layer.keys.shape[1]), None
    layer.replace_tensors({name: torch.cat([table[name], getattr(layer, name)], dim=2) for name in table})
    layer.heads_agree = bool((layer.valid == layer.valid[:, :1]).all())
    layer.all_valid = bool(layer.valid.all())


def unpacked(layer):
    """`layer` with its lanes back in its slot table (`unpack_layer`): a copy where it holds lanes, so that
    `layer` itself stays as it is (rows joined from caches left as they were); else `layer`."""
    if layer.lanes is None:
        return layer
    twin = copy.copy(layer)
    unpack_layer(twin)
    return twin


def held_table(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """`(positions, valid)` `(batch, heads, slots)` of every token a `KVLayer` holds, its lanes' and its own (for
    accounting and inspection, not for steps: lanes are unpacked into a copy)."""
    if layer.lanes is None:
        return layer.positions, layer.valid
    table = layer.lanes.table(layer.valid.shape[1], ("positions", "valid"))
    return torch.cat([table["positions"], layer.positions], 2), torch.cat([table["valid"], layer.valid], 2)

