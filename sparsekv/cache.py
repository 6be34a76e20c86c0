"""The sparsekv cache: transformers' `Cache` holding compressed layers.

A `KVLayer` stores, per KV head, the slots it keeps (any subset of the tokens seen, in any order), with each
slot's absolute position and whether it is a real token. It reports the *logical* length (every token seen) to
transformers, so new tokens keep their absolute RoPE positions, and its *physical* size for masks.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, get_layer_types_and_kwargs

# Layer types sparsekv compresses; the others (e.g. Gemma3's sliding layers) keep transformers' own layer.
COMPRESSED_LAYER_TYPES = ("full_attention",)
# Free slots added when a layer's buffers are full: decoding copies its KV once every GROW steps (a page of CHESS).
GROW = 32


class KVLayer(CacheLayerMixin):
    """One attention layer's resident KV.

    Attributes:
        keys, values: `(batch, kv_heads, slots, head_dim)`, already rotated (RoPE applied at their positions).
        positions: `(batch, kv_heads, slots)` absolute index of each slot in the (left-padded) input sequence.
        valid: `(batch, slots)` False for slots that hold no real token (padding); never attended. Validity is
            shared by the heads of a row: every head of a row keeps the same number of real tokens.
        extra: per-slot side data of a press, `(batch, kv_heads, slots)` tensors that follow their slot through
            `keep` / `evict` and are zero-filled for new tokens (e.g. H2O's accumulated attention).
        logical_len: number of tokens seen, compressed or not (what `get_seq_length` reports).
        compressed: True once the physical layout differs from the logical one.

    The per-slot tensors may be prefix views of buffers with free slots (see `_append`); presses may replace
    them with new tensors (`select`) or write into them in place, never keep views of them across steps.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self):
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.extra: dict[str, torch.Tensor] = {}
        self.logical_len = 0
        self.compressed = False
        self.all_valid = True  # no filler or padding slot: decoding needs no mask

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty tensors of the first forward's dtype, device, batch and heads."""
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.keys = key_states.new_empty(b, h, 0, d)
        self.values = value_states.new_empty(b, h, 0, value_states.shape[-1])
        self.positions = torch.empty(b, h, 0, dtype=torch.long, device=self.device)
        self.valid = torch.empty(b, 0, dtype=torch.bool, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, valid: torch.Tensor | None = None, **kwargs):
        """Append new tokens (all real unless `valid` `(batch, new)` says otherwise); return what is attended."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        new_pos = torch.arange(self.logical_len, self.logical_len + q, device=self.device)
        if valid is None:
            valid = torch.ones(b, q, dtype=torch.bool, device=self.device)
        else:
            valid = valid.to(self.device, torch.bool)
            self.all_valid = self.all_valid and bool(valid.all())
        self._append("keys", key_states)
        self._append("values", value_states)
        self._append("positions", new_pos.expand(b, h, q))
        self._append("valid", valid)
        for name in self.extra:
            self._append(name, self.extra[name].new_zeros(b, h, q), self.extra)
        self.logical_len += q
        return self.keys, self.values

    def _append(self, name: str, new: torch.Tensor, where: dict | None = None) -> None:
        """Append `new` along the slot dimension of the tensor `name` (an attribute, or a key of `where`).

        New slots are written in place into the free room behind the tensor when it has some; else (prompt, or
        after `select` made a new tensor) it moves to a buffer with `GROW` free slots, so that decoding copies a
        layer's KV once every `GROW` steps instead of at every step (as `torch.cat` does).
        """
        current = where[name] if where is not None else getattr(self, name)
        dim = slot_dim(current)
        if new.requires_grad or current.requires_grad:  # a differentiable forward: no in-place writes
            grown = torch.cat([current, new], dim=dim)
        else:
            with torch.no_grad():  # the buffer may be a view made by press work (under no_grad)
                grown = append_in_place(current, new, dim)
        if where is not None:
            where[name] = grown
        else:
            setattr(self, name, grown)

    # --- selection plumbing, used by presses -------------------------------------------------------------------
    def keep(self, scores: torch.Tensor, budgets: torch.Tensor) -> None:
        """Keep, per row and KV head, the `budgets[row]` slots with the highest `scores` `(batch, heads, slots)`.

        Slots scored `-inf` (padding) are never kept as real tokens. Rows with smaller budgets than the largest
        get invalid filler slots, ordered first, so that validity stays shared by the heads of a row.
        """
        budgets = budgets.to(scores.device)
        n_keep = int(budgets.max())
        # A stable sort breaks ties (max-pooling makes plateaus) by position, the same with or without padding.
        top = scores.sort(dim=-1, descending=True, stable=True).indices[..., :n_keep]
        real = (torch.arange(n_keep, device=scores.device) < budgets[:, None])[:, None, :]
        # Fillers first, then kept tokens by position: every head of a row gets the same validity layout.
        pos = self.positions.gather(-1, top)
        order = torch.where(real, pos, pos - self.logical_len - 1).argsort(dim=-1)
        valid = torch.arange(n_keep, device=scores.device) >= (n_keep - budgets)[:, None]
        self.select(top.gather(-1, order), valid)

    def select(self, idx: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep the slots `idx` `(batch, heads, k)`; `valid` `(batch, k)` marks which of them are real tokens."""
        gather = lambda t: t.gather(2, idx[..., None].expand(*idx.shape, t.shape[-1]))  # noqa: E731
        self.keys, self.values = gather(self.keys), gather(self.values)
        self.positions = self.positions.gather(-1, idx)
        self.extra = {name: t.gather(-1, idx) for name, t in self.extra.items()}
        self.valid = valid
        self.all_valid = bool(valid.all())
        self.compressed = True

    def evict(self, victim: torch.Tensor) -> None:
        """Drop one slot per row and head (`victim` `(batch, heads)`): the last slot moves into its place.

        Victims must be real tokens and the last slot a real (newly generated) token, so validity is unchanged.
        """
        last = self.keys.shape[-2] - 1
        v = victim[..., None]
        for name in ("keys", "values"):
            t = getattr(self, name)
            t.scatter_(2, v[..., None].expand(*v.shape, t.shape[-1]), t[:, :, last:])
            setattr(self, name, t[:, :, :last])
        self.positions = self.positions.scatter_(-1, v, self.positions[..., last:])[..., :last]
        self.extra = {n: t.scatter_(-1, v, t[..., last:])[..., :last] for n, t in self.extra.items()}
        self.valid = self.valid[:, :last]
        self.compressed = True

    # --- transformers' CacheLayerMixin API ----------------------------------------------------------------------
    def get_seq_length(self) -> int:
        """Tokens seen (not held): new tokens get their absolute positions from it."""
        return self.logical_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of the mask: the physical slots held, then the new tokens."""
        return self.slots + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "positions", "valid"):
                setattr(self, name, getattr(self, name).index_select(0, beam_idx.to(self.device)))
            self.extra = {n: t.index_select(0, beam_idx.to(self.device)) for n, t in self.extra.items()}

    def reset(self) -> None:
        self.__init__()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("A compressed sparsekv cache cannot be cropped: evicted tokens are gone.")

    def resident_slots(self) -> int:
        """KV slots this layer holds on its device per sequence."""
        return self.keys.shape[-2]

    def kv_tensors(self) -> list[torch.Tensor]:
        """The keys and values this layer holds on its device (with their free room)."""
        return [allocated(self.keys), allocated(self.values)]

    def offloaded_tensors(self) -> list[torch.Tensor]:
        """KV this layer keeps in an offload store, off the attention's device (none here)."""
        return []

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds, for memory accounting."""
        if not self.is_initialized:
            return []
        return [allocated(t) for t in (self.keys, self.values, self.positions, self.valid, *self.extra.values())]


def slot_dim(t: torch.Tensor) -> int:
    """The slot dimension of a layer's tensor: (batch, heads, slots[, head_dim]), or (batch, slots) for `valid`."""
    return min(t.dim() - 1, 2)


def buffer_of(t: torch.Tensor, slots: int) -> torch.Tensor | None:
    """The contiguous buffer of which `t` is the first slots, when it has room for `slots`; else None.

    The room is read from `t`'s own strides and storage (a view `buffer[:, :, :n]` keeps the buffer's strides), so
    no reference to a buffer is held apart from its tensor: a replaced tensor frees its buffer.
    """
    dim = slot_dim(t)
    if t.storage_offset() != 0 or t.stride(dim) == 0:
        return None
    shape = list(t.shape)
    shape[dim] = t.stride(dim - 1) // t.stride(dim)
    if shape[dim] < slots:
        return None
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    if list(t.stride()) != strides or t.untyped_storage().nbytes() < step * t.element_size():
        return None
    return t.as_strided(shape, strides)


def append_in_place(current: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    """`current` and `new` joined along `dim`: written into the room behind `current`, or into a new buffer with
    `GROW` free slots when it has none."""
    n, q = current.shape[dim], new.shape[dim]
    room = buffer_of(current, n + q)
    if room is None:
        shape = list(current.shape)
        shape[dim] = n + q + GROW
        room = current.new_empty(shape)
        room.narrow(dim, 0, n).copy_(current)
    room.narrow(dim, n, q).copy_(new)
    return room.narrow(dim, 0, n + q)


def allocated(t: torch.Tensor) -> torch.Tensor:
    """`t` with the free room behind it (what it holds in memory)."""
    room = buffer_of(t, 0)
    return t if room is None else room


@dataclass
class CacheStats:
    """What a sparsekv cache holds. Token counts are per sequence; bytes are for the whole batch.

    Attributes:
        logical_tokens: tokens seen (prompt, padding included, plus generated).
        resident_tokens: per layer, KV slots held per sequence (real or filler).
        attended_tokens: per layer, real tokens attended, averaged over the batch.
        kv_bytes: bytes of keys and values held, all layers.
        bytes_by_device: bytes of every tensor the cache holds (KV and bookkeeping), by device.
        seconds: time spent in press work, by kind (e.g. "compress", "step").
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


class SparseCache(Cache):
    """A transformers `Cache` whose full-attention layers are the press's `KVLayer`s.

    Per-generation state lives here, never on the press: prompt lengths and per-row budgets (set at prefill),
    the validity of the tokens of the current forward, time spent in press work, and `state`, a slot for a
    press's own cross-layer state.
    """

    def __init__(self, press, config):
        text_config = config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(text_config)
        layers = [
            press.new_layer(i) if t in COMPRESSED_LAYER_TYPES else DYNAMIC_LAYER_TYPE_MAPPING[t](**kw)
            for i, (t, kw) in enumerate(zip(types, kwargs))
        ]
        super().__init__(layers=layers)
        self.press = press
        self.input_valid: torch.Tensor | None = None  # (batch, new tokens) of the forward under way
        self.prompt_lengths: torch.Tensor | None = None  # (batch,) real prompt tokens
        self.prompt_start: torch.Tensor | None = None  # (batch,) index of each row's first real token
        self.budgets: torch.Tensor | None = None  # (batch,) tokens kept per row, set by the press at prefill
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)  # press events, e.g. selections, tokens loaded
        self.shared: dict | None = None  # prompt-only results, shared by the caches replayed from one Prefill
        self.state = press.new_state(self)

    def __deepcopy__(self, memo):
        """A copy (e.g. to answer several questions from one compressed context) shares the press: it is
        configuration, never state."""
        memo[id(self.press)] = self.press
        clone = memo[id(self)] = object.__new__(type(self))
        for name, value in self.__dict__.items():
            setattr(clone, name, copy.deepcopy(value, memo))
        return clone

    def prompt_work(self, key, compute):
        """`compute()`, or its result for the same `key` on the same prompt when one is at hand.

        Presses wrap work that depends only on the prompt and on what `key` names (never on the budget), so
        that a `Prefill` replayed under several presses or ratios does it once. The result is shared: do not
        modify it in place.
        """
        if self.shared is None:
            return compute()
        if key not in self.shared:
            self.shared[key] = compute()
        return self.shared[key]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        kwargs.setdefault("valid", self.input_valid)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def begin_forward(self, attention_mask: torch.Tensor | None, query_length: int, batch: int) -> None:
        """Record which of the tokens about to be processed are real, from the 2D attention mask."""
        self.input_valid = None  # None: every new token is real (the common case, and the fast path)
        if attention_mask is not None and attention_mask.ndim == 2:
            valid = attention_mask[:, -query_length:].bool()
            if not bool(valid.all()):
                self.input_valid = valid
        if self.prompt_lengths is None:
            valid = self.input_valid
            if valid is None:
                valid = torch.ones(batch, query_length, dtype=torch.bool)
            self.prompt_lengths = valid.sum(-1).cpu()
            self.prompt_start = (query_length - self.prompt_lengths).clamp(min=0)

    def stats(self) -> CacheStats:
        """What the cache holds now (see `CacheStats`)."""
        resident, attended, by_device, kv = [], [], defaultdict(int), 0
        for layer in self.layers:
            if layer.keys is None or not layer.is_initialized:
                resident.append(0)
                attended.append(0.0)
                continue
            ours = isinstance(layer, KVLayer)
            n = layer.keys.shape[-2]
            resident.append(layer.resident_slots() if ours else n)
            valid = getattr(layer, "valid", None)
            attended.append(float(valid.sum(-1).float().mean()) if valid is not None else float(n))
            kv += sum(t.nbytes for t in (layer.kv_tensors() if ours else [layer.keys, layer.values]))
            tensors = layer.held_tensors() if hasattr(layer, "held_tensors") else [layer.keys, layer.values]
            for t in tensors:
                by_device[str(t.device)] += t.nbytes
        return CacheStats(
            logical_tokens=self.get_seq_length(),
            resident_tokens=resident,
            attended_tokens=attended,
            kv_bytes=kv,
            bytes_by_device=dict(by_device),
            seconds=dict(self.seconds),
            offloaded_bytes=sum(t.nbytes for layer in self.layers if isinstance(layer, KVLayer)
                                for t in layer.offloaded_tensors()),
            counts=dict(self.counts),
            layer_jaccard=self.layer_jaccard(),
        )

    def prompt_kept(self) -> dict[int, torch.Tensor]:
        """Per compressed layer, `(batch, kv_heads, prompt)` booleans: the prompt tokens (left-padded positions)
        whose KV the layer's attention reads now (for selecting presses, at the last step)."""
        if self.prompt_lengths is None:
            return {}
        width = int(self.prompt_start[0] + self.prompt_lengths[0])  # the prompt's padded length
        kept = {}
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, KVLayer) or not layer.is_initialized:
                continue
            inside = (layer.positions < width) & layer.valid[:, None, :]
            mask = torch.zeros(*layer.positions.shape[:2], width + 1, dtype=torch.bool, device=layer.positions.device)
            kept[i] = mask.scatter_(-1, layer.positions.where(inside, width), True)[..., :width]
        return kept

    def layer_jaccard(self) -> list[float]:
        """Jaccard similarity of the prompt tokens kept by each pair of adjacent compressed layers."""
        kept = list(self.prompt_kept().values())
        pairs = []
        for a, b in zip(kept, kept[1:]):
            union = (a | b).sum(-1).clamp(min=1)
            pairs.append(float(((a & b).sum(-1) / union).mean()))
        return pairs


def cache_footprint(cache) -> tuple[float, float, int]:
    """`(resident tokens, attended tokens, KV bytes)` of a `SparseCache` or a transformers `DynamicCache`:
    tokens per sequence, mean over layers (a full cache attends everything it holds)."""
    if isinstance(cache, SparseCache):
        stats = cache.stats()
        n = len(stats.resident_tokens)
        return sum(stats.resident_tokens) / n, sum(stats.attended_tokens) / n, stats.kv_bytes
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    tokens = sum(layer.keys.shape[-2] for layer in layers) / max(len(layers), 1)
    return tokens, tokens, sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
