"""A layer whose KV lives in a store (on any device) besides the working set attention reads, gathered or loaded
from it: CHESS keeps every token there and gathers pages, SentenceKV offloads the prompt and loads sentences."""

from __future__ import annotations

import copy

import torch

from .buffers import span, step_state
from .layers import KVLayer, per_head
from .state import padded


class StoreLayer(KVLayer):
    """A layer whose KV lives in a store; attention reads a working set (`keys` / `values`) made from it.

    Attributes:
        store_keys, store_values: `(batch, kv_heads, R, head_dim)` on `store_device`.
        store_positions: `(batch, R)` absolute position of each store slot.
        store_device: where the store lives; None: the attention's device. A CPU store of a CUDA model is pinned,
            so that loads can overlap compute.
        records_tokens: every token seen is written to the store at its position (slot = position, the store
            grows), and attention reads the store itself until a working set is selected (`gather`). False: the
            store is filled once (`fill_store`) and new tokens go to the working set only.
        region: `(batch, n)` the loaded region, the working set's first `n` slots, which the press loads with
            store tokens (SentenceKV's): True where a slot holds one, False for a filler (a row that fills fewer,
            its fillers last). None: no loaded region. Its width, `loaded`, is a shape: a constant to a compiled
            step, where an int attribute would be traced as a symbol once it differs between generations.
    """

    @classmethod
    def joined(cls, layers: list[KVLayer]) -> KVLayer:
        """The rows of store layers filled once at the prompt (`fill_store`), as a batch prefilled together holds
        them: each row's store padded at its end to the widest (empty slots, which its state never loads), the
        working sets as `KVLayer.joined` with fillers at `filler_slot`. A store that records every token
        (CHESS's) is refused, and so are rows of which some kept their prompt whole (no store) and others not."""
        if any(layer.records_tokens for layer in layers):
            raise ValueError("sparsekv: layers whose store records every token (CHESS) cannot be joined; prefill "
                             "their rows together.")
        stored = [layer.store_keys is not None for layer in layers]
        if not any(stored):  # every prompt was short enough to be kept whole: plain layers
            return super().joined(layers)
        if not all(stored):
            raise ValueError(f"sparsekv: the caches {[i for i, s in enumerate(stored) if not s]} (in the order "
                             "joined) kept their prompts whole (each shorter than the tokens the press attends) and "
                             "the others did not: a batch prefilled together compresses them all; prefill these "
                             "rows together with a longer one (`rows_at_once`), or the batch together.")
        r = max(layer.store_keys.shape[2] for layer in layers)
        copies = []
        for layer in layers:
            twin = copy.copy(layer)
            # Empty slots at the last position, as `fill_store` gets them from a batch prefilled together.
            twin.store_positions = padded(layer.store_positions, 1, r, layer.logical_len - 1)
            twin.store_keys = twin.store_values = None  # joined below, straight into (pinned) memory
            copies.append(twin)
        out = super().joined(copies)
        out.store_keys, out.store_values = (_joined_store([getattr(layer, name) for layer in layers], r)
                                            for name in ("store_keys", "store_values"))
        return out

    def filler_slot(self) -> int:
        """A working set may begin with a region loaded from the store (`loaded` slots, SentenceKV's), whose
        fillers come last within it: a joined row's go there too."""
        return self.loaded

    def fillers_added(self, count: int) -> None:
        if self.region is not None:  # they went in at the loaded region's end: it holds them now
            self.region = padded(self.region, 1, self.loaded + count, False)

    @property
    def loaded(self) -> int:
        """Slots of the loaded region (`region`); 0: none."""
        return 0 if self.region is None else self.region.shape[1]

    def __init__(self, store_device: str | torch.device | None = None, records_tokens: bool = False):
        super().__init__()
        self.store_device = None if store_device is None else torch.device(store_device)
        self.records_tokens = records_tokens
        self.store_keys = self.store_values = self.store_positions = None
        self.region: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, valid: torch.Tensor | None = None,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.records_tokens:
            return super().update(key_states, value_states, valid=valid)
        if self.steps_in_place(key_states.shape[2], valid):  # a compiled cache's step: the store, then its slot
            self._record_step(key_states, value_states)
            return super().update(key_states, value_states, valid=valid)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, (b, h, q, _) = self.logical_len, key_states.shape
        self._record(key_states, value_states, start)
        if self.compressed:  # a working set was gathered: new tokens join it
            return super().update(key_states, value_states, valid=valid)
        # No working set yet: attention reads the store itself (views, no copy).
        self.valid = torch.cat([self.valid, self._new_valid(valid, b, h, q)], dim=-1)
        self.logical_len = start + q
        self._view_store()
        return self.keys, self.values

    def _view_store(self) -> None:
        """Attention's tensors as views of the store's first `logical_len` slots (slot = position)."""
        b, h = self.store_keys.shape[:2]
        end = self.logical_len
        self.keys, self.values = self.store_keys[:, :, :end], self.store_values[:, :, :end]
        self.positions = self.store_positions[:, None, :end].expand(b, h, end)

    def _record(self, keys, values, start):
        """Write tokens `start:` at their slots; grow the store by an eighth when full (the prompt and 256 more
        at first): a few copies over a long generation, little unused room."""
        end = start + keys.shape[-2]
        if self.store_keys is None or end > self.store_keys.shape[-2]:
            self._reserve(end + (256 if self.store_keys is None else max(256, end // 8)), keys, values, start)
        self.store_keys[:, :, start:end] = keys
        self.store_values[:, :, start:end] = values

    def _reserve(self, capacity: int, keys: torch.Tensor, values: torch.Tensor, kept: int) -> None:
        """A store of `capacity` slots, shaped as `keys` / `values`, holding the current one's first `kept`."""
        b, h, _, _ = keys.shape
        grown = [t.new_empty(b, h, capacity, t.shape[-1]) for t in (keys, values)]
        if self.store_keys is not None:
            grown[0][:, :, :kept], grown[1][:, :, :kept] = self.store_keys[:, :, :kept], self.store_values[:, :, :kept]
        self.store_keys, self.store_values = grown
        self.store_positions = torch.arange(capacity, device=keys.device).expand(b, capacity)

    def _record_step(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A step's token into the store at its position, one past the last token's (which the step's slot holds
        until `StepViews.write`), read on the device, where a compiled step reads nothing on the host. A store
        without room for it is a device-side error, never a token written elsewhere."""
        position = self._views.slot_n()["positions"][0, 0] + 1  # (1,): every row's token is at one position
        torch._assert_async((position < self.store_keys.shape[2]).all(), "sparsekv: a compiled cache has no room "
                            "left in its store for this step's token: make it with max_new_tokens at least "
                            "generate's (`make_cache(model, compiled=True, max_new_tokens=...)`).")
        self.store_keys.index_copy_(2, position, keys)
        self.store_values.index_copy_(2, position, values)

    def make_step_room(self, free: int = 0) -> None:
        """A store that records every token grows by `free` slots (room for the tokens a compiled cache's steps
        add, at their positions), its working set by the step's slot (`KVLayer.make_step_room`). The store's
        tensors and the loaded region are a compiled step's state (`step_state`), of sizes constant to it."""
        if self.records_tokens:
            if free > 0:
                self._reserve(self.store_keys.shape[2] + free, self.store_keys, self.store_values, self.logical_len)
            free = 0
        for t in (self.store_keys, self.store_values, self.store_positions, self.region):
            if t is not None:
                step_state(t)
        super().make_step_room(free)

    def free_slots(self) -> int:
        if self.records_tokens:  # the store's room for the tokens to come
            return self.store_keys.shape[2] - self.logical_len
        if self.loaded:  # the loaded region's fillers are not free: loads write them
            return self.slots - self.loaded - int(self.valid[..., self.loaded:].sum(-1).max())
        return super().free_slots()

    def free_mask(self) -> torch.Tensor:
        if self.loaded:
            return super().free_mask().index_fill(-1, torch.arange(self.loaded, device=self.device), False)
        return super().free_mask()

    def gather_in_place(self, slots: torch.Tensor, valid: torch.Tensor) -> None:
        """Make the working set the store slots `slots` `(batch, n)` (`valid`: which are real), written into the
        layer's own tensors of `n` slots and the step's (`make_step_room`): a compiled cache's, which keeps its
        shape. Between its steps, or in a step's graph before the step's token joins the store. (Eagerly, a layer
        whose tensors were replaced, by a reordered batch, gathers them anew and makes that room again.)"""
        if self._views is None or not self._views.held_by(self):
            self.gather(slots, valid, all_valid=False)
            self.make_step_room()
            return
        b, h = self.store_keys.shape[:2]
        keys, values = at_slots(slots, self.store_keys, self.store_values)
        self._views.rewrite(self, {  # (slot = position in a store that records every token)
            "positions": slots[:, None, :].expand(b, h, -1), "valid": valid[:, None, :],
            "keys": keys.to(self.device), "values": values.to(self.device)})

    def last_keys(self, q: int) -> torch.Tensor:
        """The keys `(batch, kv_heads, q, head_dim)` of the last forward's `q` tokens, read where they are: a
        compiled step's in its step slot (a store that records every token)."""
        if self._views is not None and self._views.held_by(self):
            return self._views.slot_n()["keys"]
        return span(self.store_keys, 2, self.logical_len - q, q)  # (one view: a slice is three ops)

    def last_slots(self, q: int) -> torch.Tensor:
        """The store slots `(batch, q)` of the last forward's `q` tokens (slot = position, in a store that records
        every token): a compiled step's read on the device."""
        if self._views is not None and self._views.held_by(self):
            return self._views.slot_n()["positions"][:, 0, :1]
        end = self.logical_len
        return torch.arange(end - q, end, device=self.store_keys.device).expand(self.store_keys.shape[0], q)

    def fill_store(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   region: torch.Tensor | None = None) -> None:
        """Make `keys` / `values` `(batch, kv_heads, R, head_dim)` at `positions` `(batch, R)` the store, and
        `region` `(batch, n)` (`region`) the working set's first `n` slots, which the press loads store tokens
        into (`load`)."""
        device = self.store_device or keys.device
        if device.type == "cpu" and keys.is_cuda:  # pinned, so that loads copy back asynchronously
            # Straight into pinned memory: one copy from the GPU, where `.to("cpu").pin_memory()` makes two.
            keys, values = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in (keys, values))
        self.store_keys, self.store_values = keys.to(device), values.to(device)
        self.store_positions = positions
        self.region = region

    def gather(self, slots: torch.Tensor | None, valid: torch.Tensor, all_valid: bool | None = None) -> None:
        """Make the working set the store slots `slots` `(batch, n)` (the same for every KV head); `valid` `(batch,
        n)`: which of them are real; `all_valid`: whether every one is, when the caller knows (else read from
        `valid`, a wait on a GPU). `slots` None: every token seen (`valid` `(batch, seen)`), at its position, as
        before the first selection: views of the store, no copy (a store that records every token)."""
        self.replace_tensors({})  # (the step views view the tensors replaced)
        b, h = self.store_keys.shape[:2]
        if slots is None:
            self._view_store()
            self.valid, self.all_valid, self.compressed = per_head(valid, h), bool(valid.all()), False
            return
        self.keys, self.values = (t.to(self.device) for t in at_slots(slots, self.store_keys, self.store_values))
        self.positions = self.store_positions.gather(1, slots)[:, None, :].expand(b, h, -1).clone()
        self.valid = per_head(valid, h)
        self.all_valid = bool(valid.all()) if all_valid is None else all_valid
        self.heads_agree = True
        self.compressed = True

    def load_region(self, slots: torch.Tensor) -> None:
        """Write the store slots `slots` `(batch, kv_heads, >= loaded)`, the first `loaded` of them, into the
        loaded region, in place, every one anew: a compiled cache's step, whose shapes stay fixed and which reads
        nothing on the host, so it cannot find which slots changed (`_load` copies only those). (Eagerly, a layer
        whose tensors were replaced, by a reordered batch, first makes its step room again.)"""
        if self._views is None or not self._views.held_by(self):
            self.make_step_room()
        n, buffers = self.loaded, self._views.grown
        slots = slots[..., :n]
        index = slots.to(self.store_keys.device)[..., None]
        # Written by index, as `StepViews.write`: a write through a view of a buffer, inductor copies it whole.
        region = torch.arange(n, device=self.device)
        for name, store in (("keys", self.store_keys), ("values", self.store_values)):
            rows = store.gather(2, index.expand(*index.shape[:3], store.shape[-1]))
            buffers[name].index_copy_(2, region, rows.to(self.device))
        b, h = slots.shape[:2]
        positions = self.store_positions.gather(1, slots.flatten(1)).view(b, h, n)
        buffers["positions"].index_copy_(2, region, positions)

    def _load(self, row: torch.Tensor, head: torch.Tensor, slot: torch.Tensor, target: torch.Tensor,
              keys: torch.Tensor, values: torch.Tensor) -> None:
        """This layer's part of `load_layers`: the store slots `(row, head, slot)`, whose rows `keys`, `values`
        `(n, d)` were read onto this layer's device, into its working-set slots `(row, head, target)`."""
        self.keys.index_put_((row, head, target), keys)
        self.values.index_put_((row, head, target), values)
        self.positions.index_put_((row, head, target), self.store_positions[row, slot])

    def crop_to(self, length: int) -> None:
        if self.is_initialized and length < self.logical_len and self.records_tokens and not self.compressed:
            self.logical_len = length  # attention reads the store: its slots past `length` are simply not read
            self.keys, self.values = self.store_keys[:, :, :length], self.store_values[:, :, :length]
            self.positions, self.valid = self.positions[..., :length], self.valid[..., :length]
            return
        super().crop_to(length)  # the working set; store slots past `length` are overwritten by the next tokens

    def attended_tensors(self) -> list[torch.Tensor]:
        if self.records_tokens and not self.compressed:
            return []  # attention reads the store itself
        return super().attended_tensors()

    def stored_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.store_keys, self.store_values) if t is not None]

    def offloaded_tensors(self) -> list[torch.Tensor]:
        return self.stored_tensors() if self.store_device is not None else []

    def resident_slots(self) -> int:
        if self.records_tokens:
            return self.logical_len  # the store holds every token
        return self.slots


def load_layers(layers: list[StoreLayer], rank: torch.Tensor | None, row: torch.Tensor, head: torch.Tensor,
                slot: torch.Tensor, target: torch.Tensor) -> None:
    """Copy store slots `(row, head, slot)` `(n,)` into working-set slots `target` of the same row and head, in the
    layers `layers[rank]` (`rank` `(n,)` sorted; None: every one in `layers[0]`). One `index_select` from a store
    and one write per tensor and layer, every head at once, by an index into the store's rows (`flat_index`)
    made once for every layer. An offloaded store's rows for every loading layer are gathered into one pinned
    buffer: one copy to the device per tensor (on a GPU one wait), not one a layer; the layers' shares are
    counted where the store is, without waiting for the device."""
    store = layers[0].store_keys  # every layer's has the same shape
    index = flat_index(store, row, head, slot)
    if offloaded(store, row.device):  # the index to the store's device, with the layer ranks when given: one copy
        if rank is None:
            index = index.to(store.device)
        else:
            rank, index = torch.stack([rank, index]).to(store.device)
    counts = [slot.numel()] if rank is None else torch.bincount(rank, minlength=len(layers)).tolist()
    ranks = [i for i, count in enumerate(counts) if count]
    loading, sizes = [layers[i] for i in ranks], [counts[i] for i in ranks]
    index = index.split(sizes)
    keys, values = (gather_rows([getattr(layer, name) for layer in loading], index)
                    .to(row.device, non_blocking=True).split(sizes) for name in ("store_keys", "store_values"))
    for layer, *part in zip(loading, *(t.split(sizes) for t in (row, head, slot, target)), keys, values):
        layer._load(*part)  # each layer's part of the indices (one `split` each, not a slice per layer)


def _joined_store(stores: list[torch.Tensor], slots: int) -> torch.Tensor:
    """Stores `(rows, kv_heads, R_i, d)` one after the other along the batch, each padded at its end to `slots`
    with zeros (empty slots, never loaded), written once into one tensor, pinned when they are: a store that
    loads asynchronously stays so."""
    first = stores[0]
    out = torch.empty((sum(t.shape[0] for t in stores), first.shape[1], slots, first.shape[3]), dtype=first.dtype,
                      device=first.device, pin_memory=first.is_pinned())
    row = 0
    for t in stores:
        out[row:row + t.shape[0], :, :t.shape[2]] = t
        out[row:row + t.shape[0], :, t.shape[2]:] = 0
        row += t.shape[0]
    return out


def at_slots(slots: torch.Tensor, *stores: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of `stores` `(batch, heads, R, d)` (of one layer: alike but in `d`) at the slots `slots` `(batch, n)`, the
    same for every head: `(batch, heads, n, d)`. Eagerly, one `index_select` a store over its rows (`flat_index`,
    made once for all), some 3x faster than torch's CPU `gather` (2.13); compiled, a gather, which inductor fuses
    into its kernel."""
    b, h, _, _ = stores[0].shape
    slots = slots.to(stores[0].device)
    if torch.compiler.is_compiling() or not all(t.is_contiguous() for t in stores):
        index = slots[:, None, :, None]
        return tuple(t.gather(2, index.expand(b, h, -1, t.shape[-1])) for t in stores)
    rows, heads = (torch.arange(n, device=slots.device) for n in (b, h))
    index = flat_index(stores[0], rows[:, None, None], heads[None, :, None], slots[:, None, :]).flatten()
    out = tuple(t.new_empty(b, h, slots.shape[1], t.shape[-1]) for t in stores)  # (tensors of their own: a view's
    for t, o in zip(stores, out):  # base would read as room behind it, `buffers.append_in_place`)
        torch.index_select(t.view(-1, t.shape[-1]), 0, index, out=o.view(-1, t.shape[-1]))
    return out


def flat_index(store: torch.Tensor, row: torch.Tensor, head: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The rows of `store` `(batch, heads, slots, d)` viewed as `(batch * heads * slots, d)` that `(row, head,
    slot)` name: one index to copy to the store's device instead of three."""
    _, h, r, _ = store.shape
    return (row * h + head) * r + slot


def offloaded(store: torch.Tensor, device: torch.device) -> bool:
    """Whether `store` lives on another device than the working set's `device` (a CPU store of a CUDA model):
    then loads gather its rows there and copy them over. (One function, so that a test can take that path on a
    CPU, where CI runs.)"""
    return store.device != device


def gather_rows(stores: list[torch.Tensor], indexes: list[torch.Tensor]) -> torch.Tensor:
    """The rows `indexes[i]` (`flat_index`) of `stores[i]`, one store's after the other, as one `(n, d)` tensor on
    their device; from pinned stores into pinned memory (torch's cached blocks), so that the one copy to the GPU
    that follows is asynchronous. Every store has the same width and dtype (a cache's layers' stores)."""
    first = stores[0]
    sizes = [index.numel() for index in indexes]
    out = torch.empty(sum(sizes), first.shape[-1], dtype=first.dtype, device=first.device,
                      pin_memory=first.is_pinned())
    for store, index, part in zip(stores, indexes, out.split(sizes)):
        if store.is_contiguous():  # sparsekv's stores are
            torch.index_select(store.view(-1, store.shape[-1]), 0, index, out=part)
        else:  # any other is indexed by the flat index's parts
            _, h, r, _ = store.shape
            part.copy_(store[index // (h * r), index // r % h, index % r])
    return out
