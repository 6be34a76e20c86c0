"""Head-wise budgets held without padding: a layer's kept prompt in lanes.

When the KV heads of a layer keep different numbers of tokens (AdaKV's head-wise budgets, KVzip's global ones), a
slot table per KV head is as wide as the layer's widest head, and the others fill it with filler slots: memory for
the widest head times the heads, not for the budget. Once the prompt is in, the core moves such a layer's tokens
into *lanes* (`pack`): rows of one fixed capacity, each lane belonging to one KV head, a head taking as many as its
tokens fill. A layer then holds its budget, plus less than one lane per head (`LANES_PER_HEAD`), and the tokens that
come after the prompt in its own slot table, as any layer (every head gets each of them).

Attention reads both in one softmax per query head (`lane_attention`): each lane's logits against the queries of its
head's group, the slot table's as usual, their maxima and sums combined per head (a scatter over the lanes), so that
no step copies the cache or pads a head. It runs inside sparsekv's attention implementation (`sparsekv.attention`),
which the hooks hand the layer's lanes to; the cost over a padded table: the same logits (fewer: no filler), a dozen
more small ops per layer and step (a compiled step fuses them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .state import RowState

# A head's tokens span this many lanes on average: a head's last lane is partly filled, so the lanes hold at most
# 1/16 more than the tokens kept (and the batch's rows, the most lanes any row needs).
LANES_PER_HEAD = 16
FLOOR = -80.0  # the lowest logit `lane_attention` exponentiates, below its head's largest


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

    def tensors(self):
        yield from (self.keys, self.values, self.positions, self.valid, self.head)

    def counts(self, heads: int) -> torch.Tensor:
        """`(batch, heads)` tokens each head holds."""
        return self.valid.sum(-1).new_zeros(self.head.shape[0], heads).scatter_add_(1, self.head, self.valid.sum(-1))

    def table(self, heads: int) -> dict[str, torch.Tensor]:
        """The lanes as a slot table per KV head, `(batch, heads, widest, ...)`, a head holding fewer than the
        widest with filler slots first (as `KVLayer.keep` lays them out): "keys", "values", "positions", "valid"."""
        b, n_lanes, cap = self.valid.shape
        counts = self.counts(heads)
        width = int(counts.max()) if counts.numel() else 0
        onehot = self.head[..., None] == torch.arange(heads, device=self.head.device)  # (b, lanes, heads)
        lane_rank = (onehot.cumsum(1) - 1).gather(-1, self.head[..., None])[..., 0]  # lane's index in its head
        slot_rank = self.valid.long().cumsum(-1) - 1 + (lane_rank * cap)[..., None]  # (lanes fill in order)
        start = (width - counts).gather(1, self.head)[..., None]  # fillers first
        target = self.head[..., None] * (width + 1) + torch.where(self.valid, start + slot_rank, width)
        target = target.view(b, -1)

        def scatter(t: torch.Tensor, fill) -> torch.Tensor:
            rest = t.shape[3:]
            out = t.new_full((b, heads * (width + 1), *rest), fill)
            index = target.view(b, -1, *([1] * len(rest))).expand(b, -1, *rest)
            out.scatter_(1, index, t.reshape(b, n_lanes * cap, *rest))
            return out.view(b, heads, width + 1, *rest)[:, :, :width]

        return {"keys": scatter(self.keys, 0), "values": scatter(self.values, 0),
                "positions": scatter(self.positions, 0), "valid": scatter(self.valid, False)}


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
    target = torch.where(valid, (first_lane[..., None] + rank // cap) * cap + rank % cap, dump).view(b, -1)

    def scatter(t: torch.Tensor, fill) -> torch.Tensor:
        rest = t.shape[3:]
        out = t.new_full((b, dump + 1, *rest), fill)
        index = target.view(b, -1, *([1] * len(rest))).expand(b, -1, *rest)
        out.scatter_(1, index, t.reshape(b, h * s, *rest))
        return out[:, :dump].reshape(b, n_lanes, cap, *rest)

    lane = torch.arange(n_lanes, device=valid.device)
    head = ((first_lane[:, None, :] <= lane[None, :, None]).sum(-1) - 1).clamp(min=0)  # (b, lanes)
    return Lanes(scatter(keys, 0), scatter(values, 0), scatter(positions, 0), scatter(valid, False), head)


def lane_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, lanes: Lanes, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """Softmax attention of `query` `(batch, heads, q, head_dim)` over a layer's `lanes` and its slot table
    (`key`, `value` `(batch, kv_heads, slots, head_dim)`, `attention_mask` over them as sdpa's or eager's, or
    None): `(output (batch, q, heads, head_dim), None)`, as transformers' attention functions return it.

    Every query sees every lane token (they are the prompt's, before any query here). In float32; a masked token
    weighs e^-80 of the largest (`FLOOR`), nothing a float32 sum keeps."""
    b, h, q, d = query.shape
    h_kv = key.shape[1]
    gq = h // h_kv * q  # the queries that read a KV head: its group's, each of the q tokens
    scaling = module.scaling if scaling is None else scaling
    qg = as_float(query).reshape(b, h_kv, gq, d) * scaling
    softcap = getattr(module, "attn_logit_softcapping", None)

    def logits(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        x = torch.matmul(queries, as_float(keys).transpose(-1, -2))
        return x if softcap is None else torch.tanh(x / softcap) * softcap

    own = logits(qg, key)  # (b, h_kv, gq, slots)
    if attention_mask is not None:  # (b, 1 or heads, q, slots + ...): to (b, 1 or h_kv, gq, slots)
        mask = attention_mask[..., : key.shape[-2]]
        mask = mask.reshape(b, h_kv, gq, -1) if mask.shape[1] == h else mask.repeat(1, 1, gq // q, 1)
        own = own.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else own + mask
    at = lanes.head[:, :, None].expand(-1, -1, gq)  # (b, lanes, gq): each lane's head
    wide = at[..., None].expand(-1, -1, -1, d)
    lane = logits(qg.gather(1, wide), lanes.keys).masked_fill_(~lanes.valid[:, :, None, :], float("-inf"))
    top = own.amax(-1).scatter_reduce_(1, at, lane.amax(-1), "amax")  # (b, h_kv, gq): each head's largest
    if q > 1:  # (a padding query sees nothing; a step's query sees its own token)
        top.masked_fill_(top == float("-inf"), 0.0)
    # Logits far below their head's largest are floored at e^-80 of it: their exp would be a subnormal float,
    # on which a CPU's exp and products run some 10x slower (measured: exp and a product of 30k, 0.2 ms against
    # 2 ms); 1e-35 of a weight is none.
    own = own.sub_(top[..., None]).clamp_min_(FLOOR).exp_()
    lane = lane.sub_(top.gather(1, at)[..., None]).clamp_min_(FLOOR).exp_()
    total = own.sum(-1).scatter_add_(1, at, lane.sum(-1))
    out = torch.matmul(own, as_float(value)).scatter_add_(1, wide, torch.matmul(lane, as_float(lanes.values)))
    out = out.div_(total[..., None])
    return out.view(b, h, q, d).transpose(1, 2).contiguous().to(value.dtype), None


def as_float(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32 (no dispatch when it is already: a decoding step's cost on a CPU is its op count)."""
    return x if x.dtype == torch.float32 else x.float()


def pack_layers(cache) -> None:
    """Once a prompt is in, move each compressed layer of `cache` whose heads hold different numbers of tokens
    into lanes (`pack_layer`), where its press does nothing over the layer's slots while decoding (its step
    scores, attention, queries or selections would miss the lanes: such a layer keeps its padded table). The
    model's attention must read them: the cache asks this only where it runs in sparsekv's implementation
    (`attention.sparsekv_implementation`)."""
    press = cache.press
    if press.scores_steps or press.reads_step_attention or press.captures_step_queries \
            or press.selects_before_attention:
        return
    for layer in cache.compressed_layers():
        pack_layer(layer)


def pack_layer(layer) -> None:
    """Move a `KVLayer`'s slots into lanes (`pack`), its own slot table left empty for the tokens after the
    prompt: a layer whose heads hold different numbers of tokens (head-wise budgets), with no per-slot data of a
    press (`extra`), which nothing will score again (the core asks: `SparseCache.end_forward`)."""
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


def held_table(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """`(positions, valid)` `(batch, heads, slots)` of every token a `KVLayer` holds, its lanes' and its own (for
    accounting and inspection, not for steps: lanes are unpacked into a copy)."""
    if layer.lanes is None:
        return layer.positions, layer.valid
    table = layer.lanes.table(layer.valid.shape[1])
    return torch.cat([table["positions"], layer.positions], 2), torch.cat([table["valid"], layer.valid], 2)

