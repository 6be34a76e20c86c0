"""Rows prefilled apart, joined into one batch laid out as a batch prefilled together (`SparseCache.join`)."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from .buffers import slot_dim
from .state import RowState, padded


def join_caches(caches: list, consume: bool = False):
    """One cache holding the rows of `caches`, in order, laid out as if their prompts had been prefilled
    together: a batch whose prefill's peak memory was one cache's, not the batch's.

    Each cache holds a prompt (left-padded to one length across the caches, with its attention mask, as a
    batch would be), built under the same press, with no forward under way. Its press must declare
    `joins_rows`. The result is a copy; the caches are left as they were, unless `consume`: then each
    cache's layers are released as soon as they are joined (the caches are unusable after), so that the rows'
    KV is never held twice, only one layer's.
    """
    caches = list(caches)
    if not caches or not all(type(c) is type(caches[0]) and hasattr(c, "press") for c in caches):
        raise ValueError("caches: give one or more sparsekv caches (a press's `make_cache`, or the cache of a "
                         "prompt prefilled under a press).")
    first = caches[0]
    press = first.press
    if any(c.press != press for c in caches):
        raise ValueError("caches: they were built under different presses "
                         f"({sorted({repr(c.press) for c in caches})}); join caches of one press.")
    check_joins_rows(press)
    if any(c.prompt_lengths is None or c.forward is not None or c.pieces is not None for c in caches):
        raise ValueError("caches: each must hold a whole prompt, with no forward under way (a cache before its "
                         "prompt, or a prompt read in pieces before its last, cannot be joined).")
    lengths = {c.get_seq_length() for c in caches}
    if len(lengths) > 1:
        raise ValueError(f"caches: they hold prompts of different lengths ({sorted(lengths)}); left-pad the "
                         "prompts to one length (with their attention mask) before prefilling them apart.")
    if len({c.budgets is None for c in caches}) > 1:
        raise ValueError("caches: some were compressed and others not; join caches prefilled alike.")
    out = type(first)(press, first.config, first.compiled, first.max_new_tokens)
    out.layers = join_layers(caches, consume)
    for name in ("prompt_lengths", "prompt_start", "budgets"):
        values = [getattr(c, name) for c in caches]
        setattr(out, name, None if values[0] is None else torch.cat(values))
    out.state = None if first.state is None else type(first.state).joined([c.state for c in caches])
    for c in caches:
        for key, value in c.seconds.items():
            out.seconds[key] += value
        for key, value in c.counts.items():
            out.counts[key] += value
    if out.compiled:
        out.ready_for_steps()  # (the joined layers are new tensors, without a step's room)
    return out


def check_joins_rows(press) -> None:
    """Refuse a press whose caches cannot be joined (`Press.joins_rows` False)."""
    if not press.joins_rows:
        raise ValueError(f"{type(press).__name__}: cannot join caches prefilled apart (its state is not laid out "
                         "per row alike: joins_rows is False); prefill the rows together.")


def join_layers(caches: list[Cache], consume: bool) -> list:
    """Every layer of `caches` joined (`joined_layer`), in order; `consume`: each cache's layer released once
    joined, so that at most one layer's rows are held twice."""
    layers = []
    for i in range(len(caches[0].layers)):
        layers.append(joined_layer([c.layers[i] for c in caches]))
        if consume:
            for c in caches:
                c.layers[i] = None
    return layers


def joined_layer(layers: list):
    """The rows of one layer of several caches: a sparsekv layer joins itself (`KVLayer.joined`); transformers'
    own layers (sliding windows) hold one tensor of keys and one of values, batch first."""
    if isinstance(layers[0], RowState):  # a sparsekv layer
        return type(layers[0]).joined(layers)
    if any(layer.keys.shape[2:] != layers[0].keys.shape[2:] for layer in layers):
        raise ValueError("sparsekv: these layers cannot be joined: they hold different numbers of tokens; join "
                         "caches of prompts padded to one length.")
    out = copy.copy(layers[0])
    out.keys = torch.cat([layer.keys for layer in layers])
    out.values = torch.cat([layer.values for layer in layers])
    return out


def padded_to_widest(layers: list) -> list:
    """Copies of `layers` (one type, as many tokens seen), each padded with invalid filler slots to the most slots
    any holds, where its layout puts them (`KVLayer.filler_slot`: first, as `keep` gives rows with smaller
    budgets), so that validity stays shared by the heads of a row. `RowState.joined` then concatenates them."""
    for layer in layers:
        layer.settle()
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
    heads_agree = all(layer.heads_agree for layer in layers)
    held = [layer.largest_budget for layer in layers if layer.largest_budget is not None]  # (head-wise budgets)
    copies = []
    for layer in layers:
        at = layer.filler_slot()

        def grown(t: torch.Tensor, fill) -> torch.Tensor:
            return padded(t, slot_dim(t), slots, fill, at)

        twin = copy.copy(layer)
        vars(twin).update(
            _keys=grown(layer.keys, 0), _values=grown(layer.values, 0), _positions=grown(layer.positions, 0),
            _valid=grown(layer.valid, False), _extra={n: grown(t, 0) for n, t in layer.extra.items()},
            compressed=compressed, all_valid=all_valid, heads_agree=heads_agree, _views=None,
            largest_budget=max(held) if held else None)
        twin.fillers_added(slots - layer.slots)
        copies.append(twin)
    return copies
