"""The speed machinery of a layer's per-slot tensors, apart from what the layer holds (`sparsekv.layers`).

Growable buffers: new slots written in place into room behind a tensor, a buffer with `GROW` free slots made when
there is none, so that decoding copies a layer's KV once every `GROW` steps instead of at every step (as
`torch.cat` does). Step views (`StepViews`): an evicting layer's views of those buffers, made once, so that its
steps write and scatter without making any."""

from __future__ import annotations

import torch

# Free slots added when a layer's buffers are full: decoding copies its KV once every GROW steps (a page of CHESS).
GROW = 32


def slot_dim(t: torch.Tensor) -> int:
    """The slot dimension of a layer's per-slot tensor, `(batch, heads, slots[, head_dim])`."""
    return min(t.dim() - 1, 2)


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


def is_prefix(t: torch.Tensor, base: torch.Tensor, dim: int) -> bool:
    """Whether `t` is `base`'s first slots along `dim` (as `base.narrow(dim, 0, n)` makes it)."""
    return (t.storage_offset() == base.storage_offset() and t.stride() == base.stride()
            and t.shape[:dim] == base.shape[:dim] and t.shape[dim + 1:] == base.shape[dim + 1:])


def allocated(t: torch.Tensor) -> torch.Tensor:
    """`t` with the free room behind it (what it holds in memory)."""
    room = buffer_of(t, 0)
    return t if room is None else room


def step_state(t: torch.Tensor) -> None:
    """Declare `t` state that compiled decoding steps write in place: CUDA graphs take its address as it is (a
    step that mutates an input at another address is skipped), and its sizes stay constants in the graph: under
    dynamo's automatic dynamic shapes, a generation of other sizes (another prompt length or budget) would trace
    them as symbols, including those of views of `t`, for which inductor fails to build guards (torch 2.13). So
    each set of sizes gets its graph: one per budget and batch size. (Nothing while compiling: a compiled
    forward of several tokens, a draft's, makes room for the steps after it over tensors dynamo traces.)"""
    if torch.compiler.is_compiling():
        return
    torch._dynamo.mark_static_address(t)
    for dim in range(t.dim()):
        torch._dynamo.mark_static(t, dim)


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """The index of the first True along the last dimension of `mask`, or its size where there is none: a
    minimum over indices, not an `argmax` over booleans, which inductor compiles wrongly (pytorch/pytorch#174069,
    #184893: indices past the end, seen as a device-side assertion on an H200)."""
    n = mask.shape[-1]
    return torch.where(mask, torch.arange(n, device=mask.device), n).amin(dim=-1)


class StepViews:
    """A layer that evicts one token a step holds `n` slots between steps and `n + 1` during one: the same
    buffers at two lengths. These are their views, made at an eviction and reused while they are the layer's
    tensors: `held` (`n` slots), `grown` (`n + 1`) and `newest` (slot `n`, where a step's token is written and
    whence an eviction moves it). A step then writes and scatters and makes no view: each view is an op to
    dispatch, and a decoding step's cost where the host is the bound is its op count. (`layer`, in each method: the
    `sparsekv.layers.KVLayer` whose tensors these view; not imported here, as layers.py imports this module.)"""

    def __init__(self, layer):
        n = layer.slots - 1
        self.grown = {"keys": layer.keys, "values": layer.values, "positions": layer.positions, "valid": layer.valid,
                      **{("extra", name): t for name, t in layer.extra.items()}}
        self.held = {k: t.narrow(slot_dim(t), 0, n) for k, t in self.grown.items()}
        self.newest = {k: t.narrow(slot_dim(t), n, 1) for k, t in self.grown.items()}
        self.extra_names = tuple(layer.extra)
        # The writes' indices: slot n, and each (row, head). Made once for eager steps; a compiled step makes them
        # in its graph, as constants (as its inputs, each would be one more tensor to guard before every step),
        # from the sizes of its buffers, static (an int of their own would be traced as a symbol).
        self._indices = self._make_indices()
        for t in self.grown.values():  # a compiled step writes into the buffers in place (its only inputs of
            step_state(t)  # them, `slot_n`)

    def _make_indices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keys = self.grown["keys"]
        (b, h, slots), device = keys.shape[:3], keys.device
        return (torch.tensor([slots - 1], device=device), torch.arange(b, device=device)[:, None, None],
                torch.arange(h, device=device)[None, :, None])

    def indices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(n, rows, heads)`: slot n `(1,)`, and each row `(b, 1, 1)` and head `(1, h, 1)` of the buffers."""
        return self._make_indices() if torch.compiler.is_compiling() else self._indices

    def _are(self, views: dict, layer) -> bool:
        return (views["keys"] is layer.keys and views["values"] is layer.values and views["positions"] is
                layer.positions and views["valid"] is layer.valid and tuple(layer.extra) == self.extra_names
                and all(views[("extra", name)] is t for name, t in layer.extra.items()))

    def held_by(self, layer) -> bool:
        """Whether `layer`'s tensors are these `n`-slot views (nothing replaced them since the eviction)."""
        return self._are(self.held, layer)

    def grown_by(self, layer) -> bool:
        return self._are(self.grown, layer)

    def write(self, layer, key_states: torch.Tensor, value_states: torch.Tensor):
        """A decoding step's token (real in every row) into slot `n`; the layer's tensors become `grown`. Slot `n`
        held the last token (an eviction moves it, and leaves it there): the new one's position is one more, found
        on the device (no position read on the host, which a compiled step would be traced anew for)."""
        # Written by index (`index_copy_`, `index_fill_`), as transformers' static cache writes: writes inductor
        # does in place, where one through a view of slot n made it copy every buffer whole at every step.
        grown, n = self.grown, self.indices()[0]
        position = self.slot_n()["positions"] + 1
        if not torch.compiler.is_compiling():  # an eager step after compiled ones: their count to the host first,
            layer.settle()  # read from slot n before this token overwrites it (`KVLayer.logical_len`)
        grown["keys"].index_copy_(2, n, key_states)
        grown["values"].index_copy_(2, n, value_states)
        grown["positions"].index_copy_(2, n, position)
        grown["valid"].index_fill_(2, n, True)
        for name in self.extra_names:
            grown[("extra", name)].index_fill_(2, n, 0)
        self._set(layer, self.grown)
        layer.count_step()
        layer.new_tokens = 1
        return layer.keys, layer.values

    def evict(self, layer, slot: torch.Tensor, reuse: bool, validity: bool = False) -> None:
        """Move slot `n` into the victims' (`slot` `(batch, heads, 1)`), its validity too when `validity` (a
        victim may be a filler slot); the layer's tensors become `held`, or with `reuse` False views made after
        these writes."""
        # By `index_put_` (not `scatter_`, which inductor does not do in place: it copied every buffer whole at
        # every step), compiled from a copy of slot n (a source that views its destination is not done in place).
        (_, rows, heads), compiling = self.indices(), torch.compiler.is_compiling()
        at = (rows, heads, slot)
        for name, token in self.slot_n().items():
            if name != "valid" or validity:
                self.grown[name].index_put_(at, token.clone() if compiling else token)
        if reuse:
            self.hold(layer)
        else:
            self._set(layer, {k: t.narrow(slot_dim(t), 0, t.shape[slot_dim(t)] - 1) for k, t in self.grown.items()})

    def slot_n(self) -> dict:
        """Slot `n` of each buffer: the views made once, or, compiling, views made in the graph. A graph then
        takes each buffer as its one input, written in place (the views made once would be more inputs over the
        same memory, which AOTAutograd merges into a base of its own: CUDA graphs then skip the step, as one
        that mutates an input whose address is not static)."""
        if torch.compiler.is_compiling():
            return {k: t.narrow(slot_dim(t), t.shape[slot_dim(t)] - 1, 1) for k, t in self.grown.items()}
        return self.newest

    def rewrite(self, layer, new: dict) -> None:
        """Write the `n` slots anew, in place: `new` maps "keys", "values", "positions" and "valid" to their
        contents (a working set gathered again at every step: a compiled CHESS cache's); the layer's tensors become
        `held`."""
        for name, t in new.items():
            self.held_view(name).copy_(t)
        self.hold(layer)

    def held_view(self, name: str) -> torch.Tensor:
        """The `n` slots of the buffer `name` ("keys", "values", "positions", "valid"), `held[name]`; compiling, a
        view made in the graph (as `slot_n`)."""
        if torch.compiler.is_compiling():
            t = self.grown[name]
            return t.narrow(slot_dim(t), 0, t.shape[slot_dim(t)] - 1)
        return self.held[name]

    def newest_position(self) -> int:
        """The position slot `n` holds: the newest token's, between steps too (a host read)."""
        return int(self.newest["positions"].flatten()[0])

    def hold(self, layer) -> None:
        """The layer's tensors become `held`: its `n` slots, between steps."""
        self._set(layer, self.held)

    def _set(self, layer, views: dict) -> None:
        layer.keys, layer.values = views["keys"], views["values"]
        layer.positions, layer.valid = views["positions"], views["valid"]
        layer.extra = {name: views[("extra", name)] for name in self.extra_names}
