"""Cache layers: what one attention layer holds for one generation.

A `KVLayer` stores, per KV head, the slots it keeps (any subset of the tokens seen, in any order), with each
slot's absolute position and whether it is a real token. It reports the *logical* length (every token seen) to
transformers, so new tokens keep their absolute RoPE positions, and its *physical* size for masks.

A `StoreLayer` keeps KV in a store (on any device) besides the working set attention reads, gathered or loaded
from it: CHESS keeps every token there and gathers pages, SentenceKV offloads the prompt and loads sentences.

Both are `RowState`s: every tensor they hold is batch-first, so reordering, batch selection and accounting are
generic (`sparsekv.state`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from .state import RowState, padded

# Free slots added when a layer's buffers are full: decoding copies its KV once every GROW steps (a page of CHESS).
GROW = 32


class _Settled:
    """A layer's per-slot tensor (or dict of them), read in its settled layout: an eviction still pending
    (`KVLayer.evict`) is carried out before anyone sees the tensor."""

    def __set_name__(self, owner, name):
        self.private = "_" + name

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        if layer.pending is not None:
            layer.settle()
        return layer.__dict__[self.private]

    def __set__(self, layer, value):
        layer.__dict__[self.private] = value


class _Written(_Settled):
    """`positions` and `valid`: also written for the decoding steps' tokens that are not yet (`KVLayer.write_tail`)
    before anyone reads or replaces them."""

    def __get__(self, layer, owner=None):
        if layer is not None and layer.unwritten:
            layer.write_tail()
        return super().__get__(layer, owner)

    def __set__(self, layer, value):
        if layer.__dict__.get("unwritten"):
            layer.write_tail()
        if self.private == "_valid":  # a new layout (appends write `_valid` itself, and do not count)
            layer.__dict__["layouts"] = layer.__dict__.get("layouts", 0) + 1
        super().__set__(layer, value)


class _Owed(_Written):
    """`StoreLayer.positions`: also the loaded slots' positions that a load left to be written when read
    (`StoreLayer.owed`), written before anyone reads or replaces the tensor."""

    def __get__(self, layer, owner=None):
        if layer is not None and layer.owed is not None:
            layer.owed.pay(layer)
        return super().__get__(layer, owner)

    def __set__(self, layer, value):
        if layer.__dict__.get("owed") is not None:
            layer.owed.pay(layer)
        super().__set__(layer, value)


class KVLayer(RowState, CacheLayerMixin):
    """One attention layer's resident KV.

    Attributes:
        keys, values: `(batch, kv_heads, slots, head_dim)`, already rotated (RoPE applied at their positions).
        positions: `(batch, kv_heads, slots)` absolute index of each slot in the (left-padded) input sequence.
        valid: `(batch, slots)` False for slots that hold no real token (padding); never attended. Validity is
            shared by the heads of a row: every head of a row keeps the same number of real tokens.
        extra: per-slot side data of a press, `(batch, kv_heads, slots)` tensors that follow their slot through
            `keep` / `evict` / `crop` and are zero-filled for new tokens (e.g. H2O's accumulated attention).
        state: the press's own state for this layer (`Press.layer_state`), a `RowState` or None.
        logical_len: number of tokens seen, compressed or not (what `get_seq_length` reports).
        compressed: True once the physical layout differs from the logical one.

    The per-slot tensors may be prefix views of buffers with free slots (see `_append`); presses may replace
    them with new tensors (`select`) or write into them in place, never keep views of them across steps.

    An eviction during decoding is left pending (`pending`, `(batch, heads)` victim slots) until the next token,
    which is written straight into its victim's slot (`update`): one write per tensor instead of moving the last
    slot into the victim's and appending. Reading any per-slot tensor settles a pending eviction first, so no
    reader ever sees the victim.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True  # the tokens of the last forward can be removed (`crop`)
    keys, values, extra = _Settled(), _Settled(), _Settled()
    positions, valid = _Written(), _Written()

    def __init__(self, state: Any = None):
        self.pending: torch.Tensor | None = None  # first: the tensors' reads check these two
        self.pending_indices: tuple[torch.Tensor, torch.Tensor] | None = None  # `victim_indices(pending)`, if given
        self.unwritten = 0  # the last slots' positions and validity, not written yet (`write_tail`)
        self.layouts = 0  # validity tensors set so far: a new one is a new layout, which a mask built may not fit
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.extra: dict[str, torch.Tensor] = {}
        self.state = state
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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, valid: torch.Tensor | None = None,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens (all real unless `valid` `(batch, new)` says otherwise); return what is attended."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        if self.pending is not None:
            if self.fills_victim(q, valid, key_states.requires_grad):
                return self._replace_victim(key_states, value_states)
            self.settle()
        if q == 1 and valid is None:  # a decoding step: its position and validity are known, written when read
            if torch.is_grad_enabled() or key_states.requires_grad:
                self._append("_keys", key_states)
                self._append("_values", value_states)
            else:  # generate's steps: straight into the buffers (`_append`'s checks are for the other cases)
                self._keys = append_in_place(self._keys, key_states, 2)
                self._values = append_in_place(self._values, value_states, 2)
            self.unwritten += 1
        else:
            if self.unwritten:
                self.write_tail()
            self._append("_keys", key_states)
            self._append("_values", value_states)
            self._append("_positions", torch.arange(self.logical_len, self.logical_len + q,
                                                    device=self.device).expand(b, h, q))
            self._append("_valid", self._new_valid(valid, b, q))
        extra = self._extra
        for name in extra:
            self._append(name, 0 if q == 1 else extra[name].new_zeros(b, h, q), extra)
        self.logical_len += q
        return self._keys, self._values

    def write_tail(self) -> None:
        """Write the positions and validity of the decoding steps' tokens appended since the last read. A step
        knows them (the next positions, real in every row and head), so it only counts them (`unwritten`): two
        fewer writes per layer and step, each an op to dispatch, which is what a step costs where the host is
        the bound (a GPU at batch 1). They are the same in every row, so reordering rows before they are
        written changes nothing."""
        n, self.unwritten = self.unwritten, 0
        if n == 1:
            self._append("_positions", self.logical_len - 1)
            self._append("_valid", True)
        elif n:
            b, h = self._positions.shape[:2]
            self._append("_positions", torch.arange(self.logical_len - n, self.logical_len,
                                                    device=self.device).expand(b, h, n))
            self._append("_valid", torch.ones(b, n, dtype=torch.bool, device=self.device))

    def fills_victim(self, q: int, valid: torch.Tensor | None, differentiable: bool) -> bool:
        """Whether a forward of `q` new tokens (`valid` as in `update`) writes its token into a pending victim's
        slot: one token, real in every row, and no gradient to keep through an in-place write. The mask built
        before `update` (`SparseCache.before_layer`) asks the same."""
        return self.pending is not None and q == 1 and valid is None and not differentiable

    def _replace_victim(self, key_states: torch.Tensor,
                        value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoding step after an eviction: its token (real in every row) takes the victim's slot."""
        if self.unwritten:
            self.write_tail()
        victim, index = self._victim_indices(key_states.shape[-1])
        self._keys.scatter_(2, index, key_states)
        if value_states.shape[-1] != key_states.shape[-1]:  # (models with other value widths)
            index = victim[..., None].expand(*victim.shape, value_states.shape[-1])
        self._values.scatter_(2, index, value_states)
        self._positions.scatter_(-1, victim, self.logical_len)
        for t in self._extra.values():
            t.scatter_(-1, victim, 0)
        self.logical_len += 1
        return self._keys, self._values

    def _new_valid(self, valid: torch.Tensor | None, b: int, q: int) -> torch.Tensor:
        if valid is None:
            return torch.ones(b, q, dtype=torch.bool, device=self.device)
        valid = valid.to(self.device, torch.bool)
        self.all_valid = self.all_valid and bool(valid.all())
        return valid

    def _append(self, name: str, new: torch.Tensor | int | bool, where: dict | None = None) -> None:
        """Append `new` along the slot dimension of the tensor `name` (an attribute, or a key of `where`); a
        Python scalar is one new slot holding that value.

        New slots are written in place into the free room behind the tensor when it has some; else (prompt, or
        after `select` made a new tensor) it moves to a buffer with `GROW` free slots, so that decoding copies a
        layer's KV once every `GROW` steps instead of at every step (as `torch.cat` does).
        """
        holder = self.__dict__ if where is None else where
        current = holder[name]
        dim = slot_dim(current)
        if getattr(new, "requires_grad", False) or current.requires_grad:  # differentiable: no in-place writes
            if not isinstance(new, torch.Tensor):
                new = current.new_full((*current.shape[:dim], 1, *current.shape[dim + 1:]), new)
            holder[name] = torch.cat([current, new], dim=dim)
            return
        if torch.is_grad_enabled():  # the buffer may be a view made by press work (under no_grad)
            with torch.no_grad():
                holder[name] = append_in_place(current, new, dim)
        else:  # generate runs without gradients: no context to enter at every step
            holder[name] = append_in_place(current, new, dim)

    # --- selection plumbing, used by presses -------------------------------------------------------------------
    def keep(self, scores: torch.Tensor, budgets: torch.Tensor) -> None:
        """Keep, per row and head, the `budgets[row]` slots with the highest `scores` `(batch, heads, slots)`.

        Slots scored `-inf` (padding) are never kept as real tokens: a row with fewer other slots than its budget
        keeps those. Rows keeping fewer than the most get invalid filler slots, ordered first, so that validity
        stays shared by the heads of a row.
        """
        budgets = torch.minimum(budgets.to(scores.device), (scores > float("-inf")).sum(-1).amin(-1))
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

    def evict(self, victim: torch.Tensor, indices: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Drop one slot per row and head (`victim` `(batch, heads)`: real tokens, or a row's filler slot, the same
        for each of its heads, where the row has room for one more token). The drop is pending: the next token
        takes the victim's slot, or `settle` moves the last slot there when anything else comes first.
        `indices`: `victim_indices(victim, head_dim)` when the caller made them (for many layers at once);
        else they are made when the eviction is carried out."""
        if self.pending is not None:
            self.settle()
        if not self.all_valid:  # a filler victim holds the next token from now on (a real one is real already)
            self.held_valid().scatter_(1, victim[:, :1], True)
        self.pending, self.pending_indices = victim, indices
        self.compressed = True

    def _victim_indices(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending victim's scatter indices (`victim_indices`), taken off the layer: the eviction is done."""
        indices = self.pending_indices
        if indices is None or indices[1].shape[-1] != width:
            indices = victim_indices(self.pending, width)
        self.pending = self.pending_indices = None
        return indices

    def settle(self) -> None:
        """Carry out a pending eviction: the last slot (a real token: the newest) moves into the victim's slot,
        so validity, shared by the heads of a row, is unchanged."""
        if self.unwritten:
            self.write_tail()
        v, _ = self._victim_indices(self._keys.shape[-1])
        last = self._keys.shape[-2] - 1
        for name in ("_keys", "_values"):
            t = self.__dict__[name]
            t.scatter_(2, v[..., None].expand(*v.shape, t.shape[-1]), t[:, :, last:])
            self.__dict__[name] = t[:, :, :last]
        self._positions = self._positions.scatter_(-1, v, self._positions[..., last:])[..., :last]
        self._extra = {n: t.scatter_(-1, v, t[..., last:])[..., :last] for n, t in self._extra.items()}
        self._valid = self._valid[:, :last]

    @classmethod
    def joined(cls, layers: list[KVLayer]) -> KVLayer:
        """One layer holding the rows of `layers` (one type, as many tokens seen), in order, as a batch prefilled
        together holds them: a row holding fewer slots than the most gets invalid filler slots where its layout
        puts them (`filler_slot`: first, as `keep` gives rows with smaller budgets), so that validity stays shared
        by the heads of a row. Pending evictions and unwritten positions are carried out first."""
        first = layers[0]
        if any(type(layer) is not type(first) or layer.logical_len != first.logical_len or not layer.is_initialized
               for layer in layers):
            raise ValueError("sparsekv: these layers cannot be joined: each must have seen the same number of "
                             f"tokens ({sorted({layer.logical_len for layer in layers})}); join caches of prompts "
                             "padded to one length.")
        slots = max(layer.slots for layer in layers)
        # The batch's flags, alike in every row's copy (the generic join requires it).
        compressed = any(layer.compressed for layer in layers)
        all_valid = all(layer.all_valid and layer.slots == slots for layer in layers)
        copies = []
        for layer in layers:
            at = layer.filler_slot()

            def grown(t: torch.Tensor, fill) -> torch.Tensor:
                return padded(t, slot_dim(t), slots, fill, at)

            twin = copy.copy(layer)
            vars(twin).update(
                _keys=grown(layer.keys, 0), _values=grown(layer.values, 0), _positions=grown(layer.positions, 0),
                _valid=grown(layer.valid, False), _extra={n: grown(t, 0) for n, t in layer.extra.items()},
                pending=None, pending_indices=None, unwritten=0, layouts=0, compressed=compressed, all_valid=all_valid)
            copies.append(twin)
        return super().joined(copies)

    def filler_slot(self) -> int:
        """Where a joined row's filler slots go (`joined`): first, where `keep` puts those of a smaller budget."""
        return 0

    # --- transformers' CacheLayerMixin API ----------------------------------------------------------------------
    def get_seq_length(self) -> int:
        """Tokens seen (not held): new tokens get their absolute positions from it."""
        return self.logical_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of the mask: the physical slots held, then the new tokens."""
        return self.slots + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def held_valid(self) -> torch.Tensor:
        """`valid` as held, without settling a pending eviction: the victim's slot counts, as real (the next
        token, real in every row, takes it)."""
        if self.unwritten:
            self.write_tail()
        return self._valid

    @property
    def slots(self) -> int:
        """Slots held, a pending eviction's victim not counted (read without settling it)."""
        keys = self.__dict__.get("_keys")
        return 0 if keys is None else keys.shape[-2] - (self.pending is not None)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise RuntimeError("sparsekv: reorder a SparseCache as a whole (`cache.reorder_cache`), not layer by layer.")

    def reset(self) -> None:
        raise RuntimeError("sparsekv: reset a SparseCache as a whole (`cache.reset()`), not layer by layer.")

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' form of `crop_to`: remove the last `-tokens_to_remove` tokens."""
        self.crop_to(self.logical_len + min(tokens_to_remove, 0))

    def crop_to(self, length: int) -> None:
        """Forget the tokens at positions `length` and after (the last forward's, e.g. a rejected draft).

        They must still be held by every head of every row (a press never evicts the tokens of the forward under
        way, `Press.hold_budget`); the slots they held are removed, the others keep their order.
        """
        if not self.is_initialized or length >= self.logical_len:
            return
        drop = self.positions >= length
        removed = self.logical_len - length
        if bool((drop.sum(-1) != removed).any()):
            raise ValueError(f"sparsekv: cannot crop the last {removed} tokens: some of them were evicted already; "
                             "crop only the tokens of the last forward.")
        kept = self.slots - removed
        if not self.compressed:  # the logical layout: the dropped tokens are the last slots
            self.keys, self.values = self.keys[:, :, :kept], self.values[:, :, :kept]
            self.positions, self.valid = self.positions[..., :kept], self.valid[:, :kept]
            self.extra = {n: t[..., :kept] for n, t in self.extra.items()}
        else:
            idx = (~drop).to(torch.int8).sort(dim=-1, descending=True, stable=True).indices[..., :kept]
            self.select(idx, self.valid.gather(1, idx[:, 0]))
        self.logical_len = length

    # --- memory accounting ----------------------------------------------------------------------------------
    def attended_tensors(self) -> list[torch.Tensor]:
        """The keys and values attention reads, with their free room."""
        return [allocated(self.keys), allocated(self.values)]

    def stored_tensors(self) -> list[torch.Tensor]:
        """KV kept besides what attention reads (a store); none here."""
        return []

    def offloaded_tensors(self) -> list[torch.Tensor]:
        """The stored KV that is offloaded (a store given its own device); none here."""
        return []

    def resident_slots(self) -> int:
        """KV slots this layer holds on its device per sequence."""
        return self.slots

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (KV and bookkeeping, the press's layer state included), each storage once."""
        if not self.is_initialized:
            return []
        seen, held = set(), []
        for t in self.tensors():
            t = allocated(t)
            key = (t.device, t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                held.append(t)
        return held


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
        owed: None, or what a load left unwritten of `positions` (an object whose `pay(layer)` writes it, and sets
            `owed` to None): a plan that loads every layer at once keeps the loaded slots' positions of all of
            them and writes a layer's only when something reads them (attention never does). Not per-row state:
            the plan's state holds the values and is reordered with the cache.
    """

    positions = _Owed()

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
        """A working set may begin with a region loaded from the store (its state's `loaded` slots, SentenceKV's),
        whose fillers come last within it: a joined row's go there too."""
        return getattr(self.state, "loaded", 0)

    def __init__(self, store_device: str | torch.device | None = None, records_tokens: bool = False, state=None):
        self.owed = None
        super().__init__(state)
        self.store_device = None if store_device is None else torch.device(store_device)
        self.records_tokens = records_tokens
        self.store_keys = self.store_values = self.store_positions = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, valid: torch.Tensor | None = None,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.records_tokens:
            return super().update(key_states, value_states, valid=valid)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, (b, h, q, _) = self.logical_len, key_states.shape
        self._record(key_states, value_states, start)
        if self.compressed:  # a working set was gathered: new tokens join it
            return super().update(key_states, value_states, valid=valid)
        # No working set yet: attention reads the store itself (views, no copy).
        self.valid = torch.cat([self.valid, self._new_valid(valid, b, q)], dim=-1)
        self.logical_len = start + q
        self._view_store()
        return self.keys, self.values

    def _view_store(self) -> None:
        """Attention's tensors as views of the store's first `logical_len` slots (slot = position)."""
        b, h = self.store_keys.shape[:2]
        end = self.logical_len
        self.keys, self.values = self.store_keys[:, :, :end], self.store_values[:, :, :end]
        self.positions = self.store_positions[:, None, :end].expand(b, h, end)

    def read_store(self, valid: torch.Tensor) -> None:
        """Drop the working set: attention reads the store itself again, every token seen (`valid` `(batch,
        seen)`: which are real), as before the first `gather`, until the next one. Views, no copy."""
        self._view_store()
        self.valid, self.all_valid, self.compressed = valid, bool(valid.all()), False

    def _record(self, keys, values, start):
        """Write tokens `start:` at their slots; grow the store by an eighth when full (the prompt and 256 more
        at first): a few copies over a long generation, little unused room."""
        end = start + keys.shape[-2]
        if self.store_keys is None or end > self.store_keys.shape[-2]:
            capacity = end + (256 if self.store_keys is None else max(256, end // 8))
            b, h, _, d = keys.shape
            grown = [t.new_empty(b, h, capacity, t.shape[-1]) for t in (keys, values)]
            if self.store_keys is not None:
                grown[0][:, :, :start], grown[1][:, :, :start] = self.store_keys[:, :, :start], \
                    self.store_values[:, :, :start]
            self.store_keys, self.store_values = grown
            self.store_positions = torch.arange(capacity, device=keys.device).expand(b, capacity)
        self.store_keys[:, :, start:end] = keys
        self.store_values[:, :, start:end] = values

    def fill_store(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Make `keys` / `values` `(batch, kv_heads, R, head_dim)` at `positions` `(batch, R)` the store."""
        device = self.store_device or keys.device
        if device.type == "cpu" and keys.is_cuda:  # pinned, so that loads copy back asynchronously
            # Straight into pinned memory: one copy from the GPU, where `.to("cpu").pin_memory()` makes two.
            keys, values = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in (keys, values))
        self.store_keys, self.store_values = keys.to(device), values.to(device)
        self.store_positions = positions

    def gather(self, slots: torch.Tensor, valid: torch.Tensor, all_valid: bool | None = None) -> None:
        """Make the working set the store slots `slots` `(batch, n)` (the same for every KV head); `all_valid`:
        whether every one of them is real, when the caller knows (else read from `valid`, a wait on a GPU)."""
        b, h = self.store_keys.shape[:2]
        index = slots[:, None, :, None].to(self.store_keys.device)
        self.keys, self.values = (t.gather(2, index.expand(b, h, -1, t.shape[-1])).to(self.device)
                                  for t in (self.store_keys, self.store_values))  # (values may be wider)
        self.positions = self.store_positions.gather(1, slots)[:, None, :].expand(b, h, -1).clone()
        self.valid = valid
        self.all_valid = bool(valid.all()) if all_valid is None else all_valid
        self.compressed = True

    def load(self, row: torch.Tensor, head: torch.Tensor, slot: torch.Tensor, target: torch.Tensor,
             rows: tuple[torch.Tensor, torch.Tensor] | None = None, owed=None) -> None:
        """Copy store slots `(row, head, slot)` into working-set slots `target` of the same row and head (one gather
        from the store and one write per tensor, every head at once). `rows`: those slots' keys and values
        `(n, d)` on this layer's device, when the caller gathered them (several layers' from an offloaded store,
        in one copy to the device). `owed`: the slots' positions are left to be written when read (`owed` above).

        The targets are loaded slots, in front of the decoding steps' tokens: their positions are written into the
        tensor as it is, without writing the steps' (`write_tail`) first, which would be six more ops a step."""
        if rows is None and not offloaded(self.store_keys, row.device):
            rows = self.store_keys[row, head, slot], self.store_values[row, head, slot]
        elif rows is None:  # an offloaded store: one index to its device, not three, and rows into pinned memory
            index = [flat_index(self.store_keys, row, head, slot)]
            rows = [gather_rows([t], index).to(self.device, non_blocking=True)
                    for t in (self.store_keys, self.store_values)]
        self.keys[row, head, target], self.values[row, head, target] = rows
        if owed is not None:
            self.owed = owed
            return
        positions = self.positions if self.pending is not None else self.__dict__["_positions"]
        positions[row, head, target] = self.store_positions[row, slot]

    def crop_to(self, length: int) -> None:
        if self.is_initialized and length < self.logical_len and self.records_tokens and not self.compressed:
            self.logical_len = length  # attention reads the store: its slots past `length` are simply not read
            self.keys, self.values = self.store_keys[:, :, :length], self.store_values[:, :, :length]
            self.positions, self.valid = self.positions[..., :length], self.valid[:, :length]
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


def slot_dim(t: torch.Tensor) -> int:
    """The slot dimension of a layer's tensor: (batch, heads, slots[, head_dim]), or (batch, slots) for `valid`."""
    return min(t.dim() - 1, 2)


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


def buffer_of(t: torch.Tensor, slots: int) -> torch.Tensor | None:
    """The contiguous buffer of which `t` is the first slots, when it has room for `slots`; else None.

    The room is read from `t`'s own strides and storage (a view `buffer[:, :, :n]` keeps the buffer's strides), so
    no reference to a buffer is held apart from its tensor: a replaced tensor frees its buffer.
    """
    if t.dim() < 2:
        return None
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
    # A tensor of its own over the storage (not a view of `t`): views of it have it as their `_base`, which is
    # how the next append finds the room (`append_in_place`).
    return t.new_empty(0).set_(t.untyped_storage(), 0, shape, strides)


def flat_index(store: torch.Tensor, row: torch.Tensor, head: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The rows of `store` `(batch, heads, slots, d)` viewed as `(batch * heads * slots, d)` that `(row, head,
    slot)` name, on the store's device: one copy there instead of three."""
    _, h, r, _ = store.shape
    return ((row * h + head) * r + slot).to(store.device)


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


def append_in_place(current: torch.Tensor, new: torch.Tensor | int | bool, dim: int) -> torch.Tensor:
    """`current` and `new` joined along `dim`: written into the room behind `current`, or into a new buffer with
    `GROW` free slots when it has none. A Python scalar `new` is one slot of that value (filled, not copied)."""
    n, q = current.shape[dim], new.shape[dim] if isinstance(new, torch.Tensor) else 1
    room = current._base  # a decoding step: the view of a buffer made by the last append (or an eviction)
    if room is None or room.shape[dim] < n + q or not is_prefix(current, room, dim):
        room = buffer_of(current, n + q)
    if room is None:
        shape = list(current.shape)
        shape[dim] = n + q + GROW
        room = current.new_empty(shape)
        room.narrow(dim, 0, n).copy_(current)
    slots = span(room, dim, n, q)
    if isinstance(new, torch.Tensor):
        slots.copy_(new)
    else:
        slots.fill_(new)
    return span(room, dim, 0, n + q)


def span(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """`t.narrow(dim, start, length)` as one op: `narrow` dispatches to `slice`, which dispatches to
    `as_strided`, and a decoding step makes two such views per appended tensor (on a GPU the step is bound by the
    host, so each op's dispatch counts)."""
    size = list(t.shape)
    size[dim] = length
    return t.as_strided(size, t.stride(), t.storage_offset() + start * t.stride(dim))


def victim_indices(victim: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`victim` `(..., batch, heads)` as scatter indices into a layer's tensors: `(..., batch, heads, 1)` for the
    per-slot ones, `(..., batch, heads, 1, width)` for keys and values. Leading dimensions make them for several
    layers at once (stacked victims), in the same few ops as for one."""
    slot = victim[..., None]
    return slot, slot[..., None].expand(*slot.shape, width)


def is_prefix(t: torch.Tensor, base: torch.Tensor, dim: int) -> bool:
    """Whether `t` is `base`'s first slots along `dim` (as `base.narrow(dim, 0, n)` makes it)."""
    return (t.storage_offset() == base.storage_offset() and t.stride() == base.stride()
            and t.shape[:dim] == base.shape[:dim] and t.shape[dim + 1:] == base.shape[dim + 1:])


def allocated(t: torch.Tensor) -> torch.Tensor:
    """`t` with the free room behind it (what it holds in memory)."""
    room = buffer_of(t, 0)
    return t if room is None else room
