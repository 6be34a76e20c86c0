"""How a `SparseCache` is copied and pickled: a copy shares the press (configuration), and pickling goes through
`torch.save`, which keeps tensors that share memory sharing it."""

from __future__ import annotations

import copy
import io

import torch


class CacheCopies:
    """`copy.copy`, `copy.deepcopy` and pickling for `sparsekv.cache.SparseCache`."""

    def __deepcopy__(self, memo):
        """A copy (e.g. to answer several questions from one compressed context) shares the press: it is
        configuration, never state."""
        memo[id(self.press)] = self.press
        memo[id(self.config)] = self.config
        clone = memo[id(self)] = object.__new__(type(self))
        for name, value in self.__dict__.items():
            setattr(clone, name, copy.deepcopy(value, memo))
        return clone

    def __copy__(self):
        """A shallow copy, as for any object (pickling goes through `torch.save`, below)."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone

    def __reduce_ex__(self, protocol):
        """Pickled through `torch.save`, which keeps tensors that share memory sharing it: a layer's tensors are
        views of buffers with room behind them, and an evicting layer's step writes through views of its own
        buffers (`sparsekv.buffers`). Plain pickle saves each view as a copy of its own, so a loaded cache's writes
        would miss the tensors attention reads, and it would continue with other tokens than the original."""
        data = io.BytesIO()
        torch.save(self.__dict__, data)
        return _load_cache, (type(self), data.getvalue())


def _load_cache(cls: type, data: bytes) -> CacheCopies:
    """A cache pickled by `SparseCache.__reduce_ex__` (what pickle and `torch.load` call to load one)."""
    cache = object.__new__(cls)
    cache.__dict__.update(torch.load(io.BytesIO(data), weights_only=False))
    return cache
