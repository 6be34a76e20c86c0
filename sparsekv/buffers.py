"""Growable buffers for a layer's per-slot tensors: new slots written in place into room behind a tensor, a
buffer with `GROW` free slots made when there is none, so that decoding copies a layer's KV once every `GROW`
steps instead of at every step (as `torch.cat` does)."""

from __future__ import annotations

import torch

# Free slots added when a layer's buffers are full: decoding copies its KV once every GROW steps (a page of CHESS).
GROW = 32


def slot_dim(t: torch.Tensor) -> int:
    """The slot dimension of a layer's tensor: (batch, heads, slots[, head_dim]), or (batch, slots) for `valid`."""
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


def victim_indices(victim: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`victim` `(..., batch, heads)` as scatter indices into a layer's tensors: `(..., batch, heads, 1)` for the
    per-slot ones, `(..., batch, heads, 1, width)` for keys and values. Leading dimensions make them for several
    layers at once (stacked victims), in the same few ops as for one."""
    slot = victim[..., None]
    return slot, slot[..., None].expand(*slot.shape, width)
