"""Cache layers: what one attention layer holds for one generation.

A `KVLayer` stores, per KV head, the slots it keeps (any subset of the tokens seen, in any order), with each
slot's absolute position and whether it is a real token. It reports the *logical* length (every token seen) to
transformers, so new tokens keep their absolute RoPE positions, and its *physical* size for masks.

A `StoreLayer` (`sparsekv.store`) keeps KV in a store besides the working set attention reads.

Both are `RowState`s: every tensor they hold is batch-first, so reordering, batch selection and accounting are
generic (`sparsekv.state`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .buffers import SlotTensors, StepViews, allocated, append_in_place, first_true, slot_dim
from .join import padded_to_widest
from .lanes import Lanes, held_table, pack_layer, unpack_layer, unpacked
from .state import RowState, padded


class KVLayer(SlotTensors, RowState, CacheLayerMixin):
    """One attention layer's resident KV.

    Attributes:
        keys, values: `(batch, kv_heads, slots, head_dim)`, already rotated (RoPE applied at their positions).
        positions: `(batch, kv_heads, slots)` absolute index of each slot in the (left-padded) input sequence.
        valid: `(batch, kv_heads, slots)` False for slots that hold no real token (padding, or a free slot);
            never attended. The heads of a row may hold different numbers of real tokens (head-wise budgets).
        heads_agree: every head of each row holds the same validity (row budgets, as every press but a head-wise
            one keeps): the mask is one per row, `(batch, 1, q, kv)`, not one per query head.
        all_valid: every slot holds a real token (no padding, no filler): attention over the layer needs no mask.
        extra: per-slot side data of a press, `(batch, kv_heads, slots)` tensors that follow their slot through
            `keep` / `evict` / `crop` and are zero-filled for new tokens (e.g. H2O's accumulated attention).
        logical_len: number of tokens seen, compressed or not (what `get_seq_length` reports; see `count_step`).
        compressed: True once the physical layout differs from the logical one.
        new_tokens: tokens the last forward appended (`hold_budget` never evicts them when they fit).

    The per-slot tensors may be prefix views of buffers with free slots (see `_append`); presses may replace
    them with new tensors (`select`) or write into them in place, never keep views of them across steps. A layer
    that evicts one token a step (`evict`) holds as many slots after every step: its steps write and scatter
    through views made once (`StepViews`), which are its tensors until anything replaces one (`SlotTensors`).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True  # the tokens of the last forward can be removed (`crop`)

    def __init__(self):
        super().__init__()
        self._seen = 0  # `logical_len` as counted on the host
        self._counted_on_device = False  # compiled steps counted tokens since (`count_step`)
        self.compressed = False
        self.new_tokens = 0  # tokens of the last forward (`update`)
        self.all_valid = True  # no filler or padding slot: decoding needs no mask
        self.heads_agree = True
        # Head-wise budgets `(batch, heads)` `keep` was given, and their largest: what each head holds while
        # decoding too (`context.hold_budget`); None: each row's budget, on every head (`SparseCache.budgets`).
        self.budgets: torch.Tensor | None = None
        self.largest_budget: int | None = None
        self.lanes: Lanes | None = None  # the kept prompt of heads of different lengths (`sparsekv.lanes`)

    @property
    def logical_len(self) -> int:
        """Tokens seen; after compiled steps and until eager code `settle`s it, read from the device."""
        if self._counted_on_device:
            return self._views.newest_position() + 1
        return self._seen

    @logical_len.setter
    def logical_len(self, value: int) -> None:
        self._seen, self._counted_on_device = value, False

    def count_step(self) -> None:
        """One more token seen, a decoding step's (`StepViews.write`, which wrote its position one past the last
        one). Compiling, on the device only: a count on the host would be an input of the step's graph, which
        dynamo traces anew for each value of a Python int it reads, and CUDA graphs record anew for each value
        of an int input. `logical_len` reads it there until eager code `settle`s it."""
        if torch.compiler.is_compiling():
            self._counted_on_device = True  # (a constant stored: nothing read, so nothing traced anew)
        else:
            self.logical_len += 1

    def settle(self) -> None:
        """The count of tokens seen back on the host, after compiled steps counted them on the device (a host
        read, once): before the step views it is read from go, or an eager step overwrites the slot it is read
        from (`StepViews.write`)."""
        if self._counted_on_device:
            self.logical_len = self.logical_len

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty tensors of the first forward's dtype, device, batch and heads."""
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.keys = key_states.new_empty(b, h, 0, d)
        self.values = value_states.new_empty(b, h, 0, value_states.shape[-1])
        self.positions = torch.empty(b, h, 0, dtype=torch.long, device=self.device)
        self.valid = torch.empty(b, h, 0, dtype=torch.bool, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, valid: torch.Tensor | None = None,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens (all real unless `valid` `(batch, new)` says otherwise); return what is attended."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        if self.steps_in_place(q, valid):
            return self._views.write(self, key_states, value_states)
        if self._views is not None:
            self.replace_tensors({})
        self._append("keys", key_states)
        self._append("values", value_states)
        self._append("positions", self.logical_len if q == 1 else torch.arange(
            self.logical_len, self.logical_len + q, device=self.device).expand(b, h, q))
        self._append("valid", True if q == 1 and valid is None else self._new_valid(valid, b, h, q))
        for name, t in self.extra.items():
            self._append(name, 0 if q == 1 else t.new_zeros(b, h, q), self.extra)
        self.logical_len += q
        self.new_tokens = q
        return self.keys, self.values

    def steps_in_place(self, q: int, valid: torch.Tensor | None) -> bool:
        """Whether a forward of `q` new tokens (`valid`: which are real, None all) writes its token into the slot
        the step views hold for it (`StepViews.write`): a decoding step, without gradients (generate's), on a
        layer that holds its step room (`make_step_room`, `evict`)."""
        return q == 1 and valid is None and self._views is not None and not torch.is_grad_enabled() \
            and self._views.held_by(self)

    def _new_valid(self, valid: torch.Tensor | None, b: int, h: int, q: int) -> torch.Tensor:
        """`(batch, kv_heads, q)` validity of `q` new tokens, from the forward's `(batch, q)` (None: all real)."""
        if valid is None:
            return torch.ones(b, h, q, dtype=torch.bool, device=self.device)
        valid = valid.to(self.device, torch.bool)
        self.all_valid = self.all_valid and bool(valid.all())
        return per_head(valid, h)

    def _append(self, name: str, new: torch.Tensor | int | bool, where: dict | None = None) -> None:
        """Append `new` along the slot dimension of the tensor `name` (a per-slot tensor of the layer's own, or a
        key of `where`); a Python scalar is one new slot holding that value.

        New slots are written in place into the free room behind the tensor when it has some; else (prompt, or
        after `select` made a new tensor) it moves to a buffer with `GROW` free slots, so that decoding copies a
        layer's KV once every `GROW` steps instead of at every step (as `torch.cat` does). A forward with gradients,
        or one `torch.compile` traces, concatenates.
        """
        holder, name = (vars(self), "_" + name) if where is None else (where, name)
        current = holder[name]
        dim = slot_dim(current)
        # Differentiable: no in-place writes. Compiling: dynamo cannot read the room behind a tensor (its storage).
        if getattr(new, "requires_grad", False) or current.requires_grad or torch.compiler.is_compiling():
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
        """Keep, per row and head, the `budgets` slots with the highest `scores` `(batch, heads, slots)`: `budgets`
        `(batch,)` per row, or `(batch, heads)` per row and head (head-wise budgets, which the layer holds while
        decoding: `self.budgets`).

        Slots scored `-inf` (padding) are never kept as real tokens: a head with fewer other slots than its budget
        keeps those (under row budgets, every head of the row keeps as few, so that its heads agree). Heads keeping
        fewer than the most get invalid filler slots, ordered first, then the kept tokens by position.
        """
        unpack_layer(self)
        scored = (scores > float("-inf")).sum(-1)  # (batch, heads)
        budgets = budgets.to(scores.device)
        heads_agree = budgets.dim() == 1
        self.budgets, self.largest_budget = (None, None) if heads_agree else (budgets, int(budgets.max()))
        budgets = torch.minimum(budgets[:, None], scored.amin(-1, keepdim=True)) if heads_agree \
            else torch.minimum(budgets, scored)  # (batch, 1) or (batch, heads)
        n_keep = int(budgets.max())
        # A stable sort breaks ties (max-pooling makes plateaus) by position, the same with or without padding.
        top = scores.sort(dim=-1, descending=True, stable=True).indices[..., :n_keep]
        slot = torch.arange(n_keep, device=scores.device)
        real = slot < budgets[..., None]
        pos = self.positions.gather(-1, top)
        order = torch.where(real, pos, pos - self.logical_len - 1).argsort(dim=-1)
        valid = (slot >= (n_keep - budgets)[..., None]).expand(*top.shape)
        self.select(top.gather(-1, order), valid, heads_agree)

    def select(self, idx: torch.Tensor, valid: torch.Tensor, heads_agree: bool | None = None) -> None:
        """Keep the slots `idx` `(batch, heads, k)`; `valid` marks which of them are real tokens: `(batch, k)`,
        the same for every head of a row, or `(batch, heads, k)` with `heads_agree` saying whether each row's
        heads hold the same (None: read from `valid`, a host read)."""
        self.settle()
        if valid.dim() == 2:
            valid, heads_agree = per_head(valid, idx.shape[1]), True
        elif heads_agree is None:
            heads_agree = bool((valid == valid[:, :1]).all())
        gather = lambda t: t.gather(2, idx[..., None].expand(*idx.shape, t.shape[-1]))  # noqa: E731
        self.replace_tensors({"keys": gather(self.keys), "values": gather(self.values),
                              "positions": self.positions.gather(-1, idx), "valid": valid.contiguous(),
                              "extra": {name: t.gather(-1, idx) for name, t in self.extra.items()}})
        self.all_valid = bool(valid.all())
        self.heads_agree = heads_agree
        self.compressed = True

    def hold_budget(self, scores: torch.Tensor, budgets: torch.Tensor, largest: int, keep_new: bool = False,
                    gather: bool = False) -> None:
        """Evict the lowest-`scores` `(batch, heads, slots)` real tokens until each row (and head) holds no more
        than its budget (`budgets` `(batch,)` or `(batch, heads)`, `largest` their maximum).

        One token over is one eviction per row and head (`evict`); more a gather (`keep`). The gather never evicts
        the last forward's own tokens when they fit the budget, nor does the eviction with `keep_new` (the forward
        is a draft being verified, or several tokens): a rejected draft can then be cropped from every head. A
        decoding step's token is scored as any other (nothing read on the host). `gather`: always a gather.
        """
        if self.slots <= largest:
            return
        budgets = budgets.to(self.device)
        if self.slots == largest + 1 and not gather:
            self.evict(self.victims(self._own_tokens_kept(scores, budgets) if keep_new else scores, budgets))
            return
        self.keep(self._own_tokens_kept(scores, budgets).masked_fill(~self.valid, float("-inf")), budgets)

    def _own_tokens_kept(self, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """`scores` with the last forward's own tokens never evicted, when they fit every row's budget."""
        if self.new_tokens <= int(budgets.min()):
            return scores.masked_fill(self.positions >= self.logical_len - self.new_tokens, float("inf"))
        return scores

    def make_step_room(self, free: int = 0) -> None:
        """Hold the slots in buffers with `free` more free slots (fillers: invalid, never attended) and one for a
        step's token, with their step views (`StepViews`), unless they are held so already: a decoding step then
        writes its token in place from the first and the layer keeps its shape at every step, compiled too (a
        compiled step cannot make room, `_append`). The step's token is kept by an eviction, of a real token (a
        press that holds its budget) or of a free slot (`keep_step_token`). The slot for it holds the newest
        position, as after an eviction."""
        if free <= 0 and self._views is not None and self._views.held_by(self):
            return
        free = max(free, 0)

        def grown(t: torch.Tensor, fill) -> torch.Tensor:
            return padded(t, slot_dim(t), t.shape[slot_dim(t)] + free + 1, fill)

        self.keys, self.values, self.valid = grown(self.keys, 0), grown(self.values, 0), grown(self.valid, False)
        self.positions = grown(self.positions, 0)
        self.positions[..., -1] = self.logical_len - 1
        self.extra = {name: grown(t, 0) for name, t in self.extra.items()}
        if free:
            self.compressed, self.all_valid = True, False
        views = StepViews(self)
        views.hold()
        self.adopt(views)

    def free_slots(self) -> int:
        """Free (filler) slots of the row that has fewest (a host read)."""
        return self.slots - int(self.valid.sum(-1).max()) if self.slots else 0

    def free_mask(self) -> torch.Tensor:
        """`(batch, heads, slots)` the slots a step's token may take (`keep_step_token`): the fillers."""
        return ~self._views.held_view("valid")

    def keep_step_token(self, slot: torch.Tensor | None = None) -> torch.Tensor | None:
        """A decoding step's token that the press did not make room for by an eviction (it keeps every token while
        decoding) moves from the step's slot into its head's first free slot, `(batch, heads)`: the layer keeps
        its shape (a compiled cache, `make_step_room`). `slot`: that slot, found by another layer of the same
        validity (`SparseCache.layouts`); None: found here. With no free slot left, a device-side error (no
        host read: the step may be a compiled graph), never an overwritten token. Returns the slot taken."""
        views = self._views
        if views is None or not views.grown_by(self):
            return None
        if slot is None:
            free = self.free_mask()
            torch._assert_async(free.any(-1).all(), "sparsekv: a compiled cache has no free slot left for this "
                                "step's token: make it with max_new_tokens at least generate's (`make_cache(model, "
                                "compiled=True, max_new_tokens=...)`).")
            slot = first_true(free)
        self.evict(slot)
        return slot

    def victims(self, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """`(batch, heads)` the slot of each row and head to evict: its lowest-`scores` real token; where the head
        holds no more real tokens than its budget (`budgets` `(batch,)` or `(batch, heads)`: a prompt kept whole,
        still growing), its first filler slot instead, which the newest token fills."""
        if self.all_valid:
            return scores.argmin(dim=-1)
        victim = scores.masked_fill(~self.valid, float("inf")).argmin(dim=-1)
        room = self.valid.sum(-1) <= (budgets[:, None] if budgets.dim() == 1 else budgets)  # (batch, heads)
        return torch.where(room, first_true(~self.valid), victim)

    def evict(self, victim: torch.Tensor) -> None:
        """Drop one slot per row and head, `victim` `(batch, heads)`: a real token, or a head's filler slot
        (`victims`). The newest slot (a real token) moves into the victim's, and the slots are one fewer."""
        views = self._views if self._views is not None and self._views.grown_by(self) else StepViews(self)
        reuse = not self.keys.requires_grad  # a forward with gradients reads no view made before these writes
        # (a filler victim holds the newest token from now on, valid; a real one is valid already)
        views.evict(self, victim[..., None], reuse, validity=not self.all_valid)
        if reuse and self._views is not views:
            self.adopt(views)
        self.compressed = True

    @classmethod
    def joined(cls, layers: list[KVLayer]) -> KVLayer:
        """The rows of `layers` as one batch prefilled together holds them (`padded_to_widest`; lanes as the rows').
        Each row is unpacked from a copy: the rows' layers stay as they are."""
        out = super().joined(padded_to_widest([unpacked(layer) for layer in layers]))
        if any(layer.lanes is not None for layer in layers):
            pack_layer(out)
        return out

    def filler_slot(self) -> int:
        """Where a joined row's filler slots go (`joined`): first, where `keep` puts those of a smaller budget."""
        return 0

    def fillers_added(self, count: int) -> None:
        """`count` filler slots went in at `filler_slot` (a row padded to join a batch, `padded_to_widest`): a
        layout that counts the slots of the region holding them grows with it. None here."""

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
        """Slots held per row and head."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def map_rows(self, fn, batch: int) -> None:
        self.replace_tensors({})  # (the step views view the tensors about to be replaced)
        super().map_rows(fn, batch)

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
            self.positions, self.valid = self.positions[..., :kept], self.valid[..., :kept]
            self.extra = {n: t[..., :kept] for n, t in self.extra.items()}
        else:
            idx = (~drop).to(torch.int8).sort(dim=-1, descending=True, stable=True).indices[..., :kept]
            self.select(idx, self.valid.gather(-1, idx), self.heads_agree)
        self.logical_len = length

    # --- memory accounting ----------------------------------------------------------------------------------
    def attended_tensors(self) -> list[torch.Tensor]:
        """The keys and values attention reads, with their free room (and lanes)."""
        lanes = [] if self.lanes is None else [self.lanes.keys, self.lanes.values]
        return [allocated(self.keys), allocated(self.values), *lanes]

    def stored_tensors(self) -> list[torch.Tensor]:
        """KV kept besides what attention reads (a store); none here."""
        return []

    def offloaded_tensors(self) -> list[torch.Tensor]:
        """The stored KV that is offloaded (a store given its own device); none here."""
        return []

    def tokens_held(self) -> torch.Tensor:
        """`(batch, kv_heads)` the tokens each row's heads hold (real ones: in lanes and slots)."""
        return held_table(self)[1].sum(-1)

    def resident_slots(self) -> int:
        """KV slots this layer holds on its device per sequence and KV head (its lanes' on average)."""
        lanes = 0 if self.lanes is None else self.lanes.valid[0].numel() // self.keys.shape[1]
        return self.slots + lanes


def per_head(valid: torch.Tensor, heads: int) -> torch.Tensor:
    """A row's validity `(batch, slots)` as every one of its `heads`' `(batch, heads, slots)`, a tensor of its own
    (it is written in place: `evict`)."""
    return valid[:, None, :].expand(-1, heads, -1).contiguous()
