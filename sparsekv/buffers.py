"""The speed machinery of a layer's per-slot tensors, apart from what the layer holds (`sparsekv.layers`).

Growable buffers: new slots written in place into room behind a tensor, a buffer with `GROW` free slots made when
there is none, so that decoding copies a layer's KV once every `GROW` steps instead of at every step (as
`torch.cat` does). Step views (`StepViews`): an evicting layer's views of those buffers, made once, so that its
steps write and scatter without making any. Where a layer's per-slot tensors live, its own or its step views'
(`SlotTensors`)."""

from __future__ import annotations

import torch

from .state import tensors_in

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


def host_reads_free(device: torch.device) -> bool:
    """Whether the host reads a value on `device` without waiting for it (a CPU): there a compiled cache may
    decide between its steps, on the host, what its steps' graphs would otherwise compute at every step (CHESS's
    selections, SentenceKV's loads); elsewhere a host read waits for the device."""
    return device.type == "cpu"


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """The index of the first True along the last dimension of `mask`, or its size where there is none: a
    minimum over indices, not an `argmax` over booleans, which inductor compiles wrongly (pytorch/pytorch#174069,
    #184893: indices past the end, seen as a device-side assertion on an H200)."""
    n = mask.shape[-1]
    return torch.where(mask, torch.arange(n, device=mask.device), n).amin(dim=-1)


class StepViews:
    """A layer that evicts one token a step holds `n` slots between steps and `n + 1` during one: the same
    buffers at two lengths. While these views are the layer's (from its first eviction, or `make_step_room`, until
    anything replaces its tensors), they are its per-slot tensors: `held` (`n` slots) between steps, `grown`
    (`n + 1`, the buffers) during one, `phase` says which (`KVLayer.keys`, ...), and `newest` is slot `n`, where
    a step's token is written and whence an eviction moves it. A step then writes and scatters and makes no view,
    nor assigns any tensor: each view is an op to dispatch, and a decoding step's cost where the host is the bound
    is its op count. A compiled step reads the buffers alone (its views of them are made in its graph), so that
    they are its only inputs of this layer's (every input is guarded before every step). (`layer`, in each method:
    the `sparsekv.layers.KVLayer` these belong to; not imported here, as layers.py imports this module.)"""

    def __init__(self, layer):
        n = layer.slots - 1
        self.grown = {"keys": layer.keys, "values": layer.values, "positions": layer.positions, "valid": layer.valid,
                      **{("extra", name): t for name, t in layer.extra.items()}}
        self.held = {k: t.narrow(slot_dim(t), 0, n) for k, t in self.grown.items()}
        self.newest = {k: t.narrow(slot_dim(t), n, 1) for k, t in self.grown.items()}
        self.extra_names = tuple(layer.extra)
        # Each phase's `layer.extra`, eagerly: one dict, so that a press's per-slot tensor replaced (not written in
        # place) while decoding is found (`write`), not lost.
        self._extras = {phase: {name: views[("extra", name)] for name in self.extra_names}
                        for phase, views in (("held", self.held), ("grown", self.grown))}
        self.phase = "grown"
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

    def tensor(self, name) -> torch.Tensor:
        """The layer's per-slot tensor `name` ("keys", "values", "positions", "valid", or `("extra", name)`) in
        this phase: compiling, a held one is a view made in the graph (`held_view`)."""
        return self.grown[name] if self.phase == "grown" else self.held_view(name)

    def extras(self) -> dict[str, torch.Tensor]:
        """The layer's `extra` in this phase: compiling, views made in the graph (a press writes them in place)."""
        if torch.compiler.is_compiling():
            return {name: self.tensor(("extra", name)) for name in self.extra_names}
        return self._extras[self.phase]

    def held_by(self, layer) -> bool:
        """Whether `layer` holds these views' `n` slots (between steps)."""
        return layer._views is self and self.phase == "held"

    def grown_by(self, layer) -> bool:
        """Whether `layer` holds these views' `n + 1` slots (a step's token written, not yet kept)."""
        return layer._views is self and self.phase == "grown"

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
            self._check_extras()
        grown["keys"].index_copy_(2, n, key_states)
        grown["values"].index_copy_(2, n, value_states)
        grown["positions"].index_copy_(2, n, position)
        grown["valid"].index_fill_(2, n, True)
        for name in self.extra_names:
            grown[("extra", name)].index_fill_(2, n, 0)
        self.phase = "grown"
        layer.count_step()
        layer.new_tokens = 1
        return grown["keys"], grown["values"]

    def _check_extras(self) -> None:
        for phase, views in (("held", self.held), ("grown", self.grown)):
            if any(t is not views[("extra", name)] for name, t in self._extras[phase].items()) \
                    or len(self._extras[phase]) != len(self.extra_names):
                raise RuntimeError("sparsekv: a press replaced or added a per-slot tensor of `ctx.extra` while "
                                   "decoding; write it in place there (`ctx.extra[name] += ...`), add it at the "
                                   "prompt (`compress`).")

    def evict(self, layer, slot: torch.Tensor, reuse: bool, validity: bool = False) -> None:
        """Move slot `n` into the victims' (`slot` `(batch, heads, 1)`), its validity too when `validity` (a
        victim may be a filler slot); the layer's tensors become `held`, or with `reuse` False views made after
        these writes (the layer's own: these views are let go)."""
        # By `index_put_` (not `scatter_`, which inductor does not do in place: it copied every buffer whole at
        # every step), compiled from a copy of slot n (a source that views its destination is not done in place).
        (_, rows, heads), compiling = self.indices(), torch.compiler.is_compiling()
        at = (rows, heads, slot)
        for name, token in self.slot_n().items():
            if name != "valid" or validity:
                self.grown[name].index_put_(at, token.clone() if compiling else token)
        if reuse:
            self.hold()
        else:
            held = {k: t.narrow(slot_dim(t), 0, t.shape[slot_dim(t)] - 1) for k, t in self.grown.items()}
            layer.replace_tensors({**{k: held[k] for k in ("keys", "values", "positions", "valid")},
                                   "extra": {name: held[("extra", name)] for name in self.extra_names}})

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
        # Compiled, by index (`index_copy_` over the first n slots), as `write`: a copy into a view of the buffer
        # made inductor write each layer's buffers into new ones and copy them back whole, at the end of every step.
        # Eagerly (between compiled steps, on a CPU), into the held views: one op a tensor.
        if not torch.compiler.is_compiling():
            for name, t in new.items():
                self.held[name].copy_(t)
            self.hold()
            return
        for name, t in new.items():
            buffer = self.grown[name]
            dim = slot_dim(buffer)
            held = torch.arange(buffer.shape[dim] - 1, device=buffer.device)
            t = t.expand(self.held_view(name).shape)
            if buffer.dtype == torch.bool:  # as the bytes they are: inductor's CPU code (torch 2.13) writes bool
                buffer, t = buffer.view(torch.uint8), t.view(torch.uint8)  # tensors ~7x slower than bytes
            buffer.index_copy_(dim, held, t)
        self.hold()

    def held_view(self, name) -> torch.Tensor:
        """The `n` slots of the buffer `name` (as `tensor`), `held[name]`; compiling, a view made in the graph (as
        `slot_n`)."""
        if torch.compiler.is_compiling():
            t = self.grown[name]
            return t.narrow(slot_dim(t), 0, t.shape[slot_dim(t)] - 1)
        return self.held[name]

    def newest_position(self) -> int:
        """The position slot `n` holds: the newest token's, between steps too (a host read)."""
        return int(self.newest["positions"].flatten()[0])

    def hold(self) -> None:
        """The layer's tensors become `held`: its `n` slots, between steps."""
        self.phase = "held"

    def current(self) -> dict:
        """The layer's per-slot tensors in this phase, by attribute name (what it holds once these go)."""
        return {"keys": self.tensor("keys"), "values": self.tensor("values"), "positions": self.tensor("positions"),
                "valid": self.tensor("valid"), "extra": dict(self.extras())}


def _slot_tensor(name: str) -> property:
    """The layer's per-slot tensor `name`: read from its step views while they hold, else from its own home
    (`_name`); assigned, the layer's own (`SlotTensors.replace_tensors`)."""
    own = "_" + name

    def get(layer):
        views = layer._views
        if views is None:
            return getattr(layer, own)
        return views.extras() if name == "extra" else views.tensor(name)

    def put(layer, value):
        layer.replace_tensors({name: value})

    return property(get, put)


class SlotTensors:
    """A layer's per-slot tensors, `keys`, `values`, `positions`, `valid` and `extra` (see `KVLayer`): its own, or
    while its step views hold (`StepViews`: from its first eviction, or its step room, until anything replaces one
    of them), theirs. One home at a time: a compiled step then reads the views' buffers alone (its views of them
    made in its graph, where views held as the layer's attributes would be more inputs to guard before every
    step) and assigns no tensor (each a Python store replayed after its graph)."""

    def __init__(self, *args, **kwargs):
        self._views: StepViews | None = None
        super().__init__(*args, **kwargs)  # (transformers' layer sets `keys` and `values` to None)
        self._keys = self._values = self._positions = self._valid = None  # (their own homes)
        self._extra: dict[str, torch.Tensor] = {}

    keys, values, positions, valid, extra = (_slot_tensor(name) for name in
                                             ("keys", "values", "positions", "valid", "extra"))

    def replace_tensors(self, new: dict) -> None:
        """Make `new` (attribute name to tensor, or to a dict for "extra") the layer's own per-slot tensors; its
        step views, while they hold, are let go first (what they held becomes the layer's own)."""
        if self._views is not None:
            self.settle()  # (a count made by compiled steps is read from the views)
            own, self._views = self._views.current(), None
            new = {**own, **new}
        for name, value in new.items():
            setattr(self, "_" + name, value)

    def adopt(self, views: StepViews) -> None:
        """`views` (made of the layer's current tensors) become its per-slot tensors, which have no other home."""
        self._views = views
        self._keys = self._values = self._positions = self._valid = None
        self._extra = {}

    def tensors(self):
        yield from super().tensors()
        if self._views is not None:  # (the views' buffers: what they hold in memory)
            yield from tensors_in(self._views.grown)
