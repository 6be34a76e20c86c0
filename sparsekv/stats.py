"""What a cache holds: its tokens, bytes and press work (`CacheStats`), and the prompt tokens each layer reads."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from .buffers import allocated
from .lanes import held_table
from .layers import KVLayer
from .state import RowState


@dataclass
class CacheStats:
    """What a sparsekv cache holds. Token counts are per sequence; bytes are for the whole batch.

    Attributes:
        logical_tokens: tokens seen (prompt, padding included, plus generated).
        resident_tokens: per layer, KV slots held per sequence (real or filler).
        attended_tokens: per layer, real tokens attended, averaged over the batch.
        kv_bytes: bytes of keys and values held, all layers.
        bytes_by_device: bytes of every tensor the cache holds (KV and bookkeeping), by device.
        seconds: time spent in press work: "compress" (the prompt) and "step" (every later forward); a forward
            run compiled (`torch.compile`) is not timed.
        offloaded_bytes: bytes of KV a press keeps off the device in an offload store (e.g. SentenceKV's).
        counts: press events by kind (e.g. "selections", "loads", "loaded_tokens").
        layer_jaccard: per pair of adjacent compressed layers, the Jaccard similarity of the prompt tokens they
            keep (per row and KV head, averaged): how alike neighbouring layers' selections are.
    """

    logical_tokens: int
    resident_tokens: list[int]
    attended_tokens: list[float]
    kv_bytes: int
    bytes_by_device: dict[str, int]
    seconds: dict[str, float] = field(default_factory=dict)
    offloaded_bytes: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    layer_jaccard: list[float] = field(default_factory=list)

    @property
    def kv_fraction(self) -> float:
        """Mean resident slots over logical tokens."""
        mean = sum(self.resident_tokens) / max(len(self.resident_tokens), 1)
        return mean / max(self.logical_tokens, 1)


def cache_stats(cache) -> CacheStats:
    """What the cache holds now (see `CacheStats`)."""
    resident, attended, by_device, kv, offloaded = [], [], defaultdict(int), 0, 0
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or not layer.is_initialized:  # (or a linear-attention state)
            resident.append(0)
            attended.append(0.0)
            continue
        if not isinstance(layer, KVLayer):  # transformers' own layer: it attends what it holds
            n = layer.keys.shape[-2]
            resident.append(n)
            attended.append(float(n))
            kv += layer.keys.nbytes + layer.values.nbytes
            for t in (layer.keys, layer.values):
                by_device[str(t.device)] += t.nbytes
            continue
        resident.append(layer.resident_slots())
        attended.append(float(held_table(layer)[1].sum(-1).float().mean()))
        away = layer.offloaded_tensors()
        offloaded += sum(t.nbytes for t in away)
        seen = set()  # the store may be what attention reads (CHESS before its first selection)
        for t in layer.attended_tensors() + [t for t in layer.stored_tensors() if not any(t is a for a in away)]:
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                kv += t.nbytes
        for t in held_tensors(layer):
            by_device[str(t.device)] += t.untyped_storage().nbytes()
    if isinstance(cache.state, RowState):  # the press's (CHESS's page sums, SentenceKV's sentence vectors)
        for t in distinct(cache.state.tensors()):
            by_device[str(t.device)] += t.untyped_storage().nbytes()
    return CacheStats(
        logical_tokens=cache.get_seq_length(),
        resident_tokens=resident,
        attended_tokens=attended,
        kv_bytes=kv,
        bytes_by_device=dict(by_device),
        seconds=dict(cache.seconds),
        offloaded_bytes=offloaded,
        counts=event_counts(cache),
        layer_jaccard=layer_jaccard(cache),
    )


def prompt_kept(cache) -> dict[int, torch.Tensor]:
    """Per compressed layer, `(batch, kv_heads, prompt)` booleans: the prompt tokens (left-padded positions)
    whose KV the layer's attention reads now (for selecting presses, at the last step)."""
    if cache.prompt_lengths is None:
        return {}
    width = int(cache.prompt_start[0] + cache.prompt_lengths[0])  # the prompt's padded length
    kept = {}
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, KVLayer) or not layer.is_initialized:
            continue
        positions, valid = held_table(layer)
        inside = (positions < width) & valid
        mask = torch.zeros(*positions.shape[:2], width + 1, dtype=torch.bool, device=positions.device)
        kept[i] = mask.scatter_(-1, positions.where(inside, width), True)[..., :width]
    return kept


def layer_jaccard(cache) -> list[float]:
    """Jaccard similarity of the prompt tokens kept by each pair of adjacent compressed layers."""
    kept = list(prompt_kept(cache).values())
    pairs = []
    for a, b in zip(kept, kept[1:]):
        union = (a | b).sum(-1).clamp(min=1)
        pairs.append(float(((a & b).sum(-1) / union).mean()))
    return pairs


def cache_footprint(cache) -> tuple[float, float, int]:
    """`(resident tokens, attended tokens, KV bytes)` of a `SparseCache` or a transformers `DynamicCache`:
    tokens per sequence, mean over layers (a full cache attends everything it holds)."""
    if isinstance(cache, RowState):  # a SparseCache
        stats = cache.stats()
        n = len(stats.resident_tokens)
        return sum(stats.resident_tokens) / n, sum(stats.attended_tokens) / n, stats.kv_bytes
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    tokens = sum(layer.keys.shape[-2] for layer in layers) / max(len(layers), 1)
    return tokens, tokens, sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)


def held_tensors(layer) -> list[torch.Tensor]:
    """Every tensor a sparsekv `layer` holds (KV and bookkeeping), each storage once."""
    return distinct(layer.tensors()) if layer.is_initialized else []


def distinct(tensors) -> list[torch.Tensor]:
    """The tensors `tensors` are views of (`allocated`), each storage once."""
    seen, held = set(), []
    for t in tensors:
        t = allocated(t)
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            held.append(t)
    return held


def event_counts(cache) -> dict[str, int]:
    """Press events by kind: the cache's counts and those the press's state keeps per row (`RowState.event_counts`)."""
    counts = dict(cache.counts)
    for kind, n in (cache.state.event_counts() if isinstance(cache.state, RowState) else {}).items():
        counts[kind] = counts.get(kind, 0) + n
    return counts


def clock() -> float | None:
    """Now, to time press work (`SparseCache.seconds`); None inside a compiled forward, whose press work is not
    timed: the clock is not traced (a graph break at every layer), and a compiled graph runs as one piece."""
    return None if torch.compiler.is_compiling() else time.perf_counter()
