"""A `SparseCache`'s batch operations (beam search's `reorder_cache`, `batch_select_indices`,
`batch_repeat_interleave`), written once over its layers and press state (`RowState`s, `sparsekv.state`)."""

from __future__ import annotations

import torch

from .state import RowState, row_index


class CacheRows:
    """The batch operations of `sparsekv.cache.SparseCache`: every layer and every piece of press state."""

    def _map_rows(self, op: str, arg) -> None:
        if self.prompt_lengths is None:
            return
        fn, batch = row_index(op, arg), self.prompt_lengths.shape[0]
        name = {"reorder": "reorder_cache", "select": "batch_select_indices", "repeat": "batch_repeat_interleave"}
        for layer in self.layers:
            if isinstance(layer, RowState):
                layer.map_rows(fn, batch)
            else:
                getattr(layer, name[op])(arg)
        self.map_rows(fn, batch)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row `i` becomes row `beam_idx[i]`, in every layer and every piece of press state."""
        self._map_rows("reorder", beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows("select", indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows("repeat", repeats)
