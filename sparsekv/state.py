"""Per-generation state that the core reorders, selects, repeats, copies and measures without knowing its press.

Every object holding state for one generation (a cache layer, a press's per-layer or per-generation state)
derives from `RowState`. The contract is one rule: **every tensor it holds has the batch first** (or 1,
broadcast over the rows), also inside dicts, lists and tuples, unless its attribute is named in `shared_state`.
Beam search (`reorder_cache`), `batch_select_indices`, `batch_repeat_interleave` and memory accounting are then
written once, here, and a new attribute is covered by existing: nothing to register, nothing to forget. A tensor
that breaks the rule (its first dimension is not the batch) raises when the batch is reordered, naming the
attribute.
"""

from __future__ import annotations

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
                # A leading underscore is storage behind a public attribute (KVLayer's `keys` is `_keys`).
                setattr(self, name, _map(value, fn, batch, f"{type(self).__name__}.{name.lstrip('_')}"))

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor held (per row or shared), recursively: what memory accounting counts."""
        for value in vars(self).values():
            yield from _tensors(value)


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


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, RowState):
        yield from value.tensors()
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def row_index(fn_name: str, arg) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-tensor function of a batch operation: "reorder" / "select" (rows `arg`) or "repeat" (`arg` times)."""
    if fn_name == "repeat":
        return lambda t: t.repeat_interleave(arg, dim=0)
    if fn_name == "select":  # transformers passes indices or a boolean mask
        return lambda t: t[arg.to(t.device)]
    return lambda t: t.index_select(0, arg.to(t.device))
