"""Per-generation state that the core reorders, selects, repeats, copies and measures without knowing its press.

Every object holding state for one generation (a cache layer, a press's per-layer or per-generation state)
derives from `RowState`. The contract is one rule: **every tensor it holds has the batch first** (or 1,
broadcast over the rows), also inside dicts, lists and tuples, unless its attribute is named in `shared_state`.
Beam search (`reorder_cache`), `batch_select_indices`, `batch_repeat_interleave`, joining rows prefilled apart
(`joined`) and memory accounting are then written once, here, and a new attribute is covered by existing:
nothing to register, nothing to forget. A tensor that breaks the rule (its first dimension is not the batch)
raises when the batch is reordered, naming the attribute.
"""

from __future__ import annotations

import copy
from typing import Callable, ClassVar, Iterator

import torch


class RowState:
    """Base of every object holding one generation's state; see the module docstring for the contract.

    Attributes:
        shared_state: names of attributes that are not per row (class attribute; e.g. a table shared by all
            rows). Non-tensor attributes (ints, flags, dicts of ints) are left alone without being named.
    """

    shared_state: ClassVar[frozenset[str]] = frozenset()

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor], batch: int) -> None:
        """Replace every per-row tensor `t` (batch first, `batch` rows) by `fn(t)`, recursively."""
        for name, value in list(vars(self).items()):
            if name not in self.shared_state:
                setattr(self, name, _map(value, fn, batch, f"{type(self).__name__}.{self._public(name)}"))

    def _public(self, name: str) -> str:
        """The name users read attribute `name` by: a property's, where the attribute is its home (`_keys`)."""
        return name[1:] if name.startswith("_") and isinstance(getattr(type(self), name[1:], None), property) \
            else name

    @classmethod
    def joined(cls, states: list[RowState]) -> RowState:
        """One state holding the rows of `states` (each of the same type and layout), in order: every per-row
        tensor concatenated along the batch; shared attributes and everything else taken from the first, which
        must equal the others'. Raises naming the attribute whose rows cannot be joined."""
        first = states[0]
        out = object.__new__(type(first))
        for name, value in vars(first).items():
            values = [vars(state)[name] for state in states]
            where = f"{type(first).__name__}.{first._public(name)}"
            vars(out)[name] = value if name in first.shared_state else _join(values, where)
        return out

    def event_counts(self) -> dict[str, int]:
        """Press events this state counts per row (on the device, so that a step reads nothing on the host), by
        kind: `SparseCache.stats` adds them to the cache's own counts. None by default."""
        return {}

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor held (per row or shared), recursively: what memory accounting counts."""
        for value in vars(self).values():
            yield from tensors_in(value)


def padded(t: torch.Tensor, dim: int, size: int, fill, at: int | None = None) -> torch.Tensor:
    """`t` grown to `size` along `dim` with slots of `fill` inserted before index `at` (default: at the end): what
    rows joined from caches of different widths need, so that each row keeps the layout it would have in a batch
    prefilled together. `t` itself when it has `size` already."""
    n = t.shape[dim]
    if n == size:
        return t
    at = n if at is None else at
    shape = list(t.shape)
    shape[dim] = size - n
    return torch.cat([t.narrow(dim, 0, at), t.new_full(shape, fill), t.narrow(dim, at, n - at)], dim=dim)


def _map(value, fn, batch: int, where: str):
    if isinstance(value, torch.Tensor):
        if value.dim() > 0 and value.shape[0] == 1 and batch > 1:
            return value  # broadcast over the rows (e.g. a RoPE table made without position ids)
        if value.dim() == 0 or value.shape[0] != batch:
            raise TypeError(f"sparsekv: {where} has shape {tuple(value.shape)}, not batch-first for a batch of "
                            f"{batch}; per-row state must have the batch first (or be named in `shared_state`).")
        return fn(value)
    if isinstance(value, RowState):
        value.map_rows(fn, batch)
        return value
    if isinstance(value, (dict, list)):  # in place: a dict keeps its type (e.g. a defaultdict)
        for k, v in list(value.items() if isinstance(value, dict) else enumerate(value)):
            value[k] = _map(v, fn, batch, f"{where}[{k!r}]")
        return value
    if isinstance(value, tuple):
        return tuple(_map(v, fn, batch, f"{where}[{i}]") for i, v in enumerate(value))
    return value


def _join(values: list, where: str):
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0 or any(v.shape[1:] != first.shape[1:] for v in values):
            raise ValueError(f"sparsekv: {where} cannot be joined: its shapes differ between the rows "
                             f"({sorted({tuple(v.shape) for v in values})}); join caches of prompts of one length.")
        return torch.cat(values)
    if isinstance(first, RowState):
        return type(first).joined(values)
    if isinstance(first, dict):
        if any(v.keys() != first.keys() for v in values):
            raise ValueError(f"sparsekv: {where} cannot be joined: its keys differ between the rows.")
        out = copy.copy(first)  # (keeps its type, e.g. a defaultdict)
        for k in first:
            out[k] = _join([v[k] for v in values], f"{where}[{k!r}]")
        return out
    if isinstance(first, (list, tuple)):
        if any(len(v) != len(first) for v in values):
            raise ValueError(f"sparsekv: {where} cannot be joined: its lengths differ between the rows.")
        joined = [_join(list(parts), f"{where}[{i}]") for i, parts in enumerate(zip(*values))]
        return joined if isinstance(first, list) else tuple(joined)
    if any(v is not first and v != first for v in values):
        raise ValueError(f"sparsekv: {where} cannot be joined: it differs between the rows ({values!r}).")
    return first


def tensors_in(value) -> Iterator[torch.Tensor]:
    """Every tensor in `value`: a tensor, a `RowState`, or dicts, lists and tuples of them, recursively."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, RowState):
        yield from value.tensors()
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)


def row_index(fn_name: str, arg) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-tensor function of a batch operation: "reorder" / "select" (rows `arg`) or "repeat" (`arg` times)."""
    if fn_name == "repeat":
        return lambda t: t.repeat_interleave(arg, dim=0)
    if fn_name == "select":  # transformers passes indices or a boolean mask
        return lambda t: t[arg.to(t.device)]
    return lambda t: t.index_select(0, arg.to(t.device))
