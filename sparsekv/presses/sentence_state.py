"""SentenceKV's per-generation state: each prompt token's sentence, each layer's sentence vectors, mean query and
loaded slots (`SentenceLayerState`), and with `plan="step"` every layer's stacked (`LayerStack`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..state import RowState, padded


@dataclass
class SentenceState(RowState):
    """Per generation: each prompt token's sentence."""

    sentences: torch.Tensor | None = None  # (batch, prompt) sentence index, -1 for padding
    piece_ids: torch.Tensor | None = None  # (batch, read) a prompt read in pieces: its tokens until the last piece
    step_ids: torch.Tensor | None = None  # (batch, q) the last forward's tokens, for `crop`
    stack: LayerStack | None = None  # `plan="step"`: every layer's ranking state, once the layers are compressed
    per_layer: bool = False  # `plan="step"` over layers on several devices: each layer ranks at its query


@dataclass
class LayerStack(RowState):
    """`SentencePress(plan="step")`: the ranking state of every compressed layer, stacked on dim 1 (batch first,
    then layers), so that a step ranks and loads for all layers with one set of ops. The fields are those of
    `SentenceLayerState` with a layer dimension; sentences are padded to the layer with the most (empty ones: no
    tokens, never loaded). Built from the layers' states at the first forward after the prompt, which give theirs
    up (None): from then on this is the one copy.
    """

    ranks: dict[int, int] = field(default_factory=dict)  # layer index -> its index on dim 1
    last: int = -1  # the last stacked layer's index: the step's queries join the sums after it
    query_sum: torch.Tensor | None = None  # (batch, layers, kv_heads, 1, head_dim)
    sentence_keys: torch.Tensor | None = None  # (batch, layers, kv_heads, sentences, head_dim or 2 head_dim)
    sentence_sizes: torch.Tensor | None = None  # (batch, layers, 1, sentences)
    slot_sentence: torch.Tensor | None = None  # (batch, layers, kv_heads, R)
    slot_room: torch.Tensor | None = None  # (batch, layers, 1, R)
    resident: torch.Tensor | None = None  # (batch, layers, kv_heads, R)
    device_slot: torch.Tensor | None = None  # (batch, layers, kv_heads, R)
    step_queries: list | torch.Tensor = field(default_factory=list)  # per layer, the last forward's queries
    # `(batch, kv_heads, q, d)`, or all layers' `(batch, layers, kv_heads, 1, d)` when they were added at once
    projected: list = field(default_factory=list)  # per layer, a one-token step's query projection, until `last`
    rope: torch.Tensor | None = None  # the RoPE matrix of those projections (the step's, shared by its layers)
    heads: int = 0  # query heads per layer
    before_reset: torch.Tensor | None = None  # query_sum before a sentence end zeroed it, for `crop`

    shared_state: ClassVar[frozenset[str]] = frozenset({"rope"})
    STACKED: ClassVar[tuple[str, ...]] = ("query_sum", "sentence_keys", "sentence_sizes", "slot_sentence",
                                          "slot_room", "resident", "device_slot")


@dataclass
class SentenceLayerState(RowState):
    """Per layer: the sentence vectors, the mean query, and which store slots are loaded where.

    The layer's working set is `[loaded | sinks + recent window + generated tokens]`: its first `loaded` slots
    hold selected store tokens in no particular order (a row's `fill` real ones, then fillers); only tokens
    that enter the selection are copied in.
    """

    loaded: int = 0  # slots of the loaded region
    sentence_keys: torch.Tensor | None = None  # (batch, kv_heads, sentences, head_dim) eq. 1; (..., 2 head_dim) bounds
    query_sum: torch.Tensor | None = None  # (batch, kv_heads, 1, head_dim): the sentence being generated
    resident: torch.Tensor | None = None  # (batch, kv_heads, R) store slots now loaded
    device_slot: torch.Tensor | None = None  # (batch, kv_heads, R) loaded slot of each resident one
    fill: torch.Tensor | None = None  # (batch, 1, 1) loaded slots a row fills (the others: fillers, last)
    slot_sentence: torch.Tensor | None = None  # (batch, kv_heads, R) sentence of each store slot
    slot_room: torch.Tensor | None = None  # (batch, 1, R) see `loading_room`
    sentence_sizes: torch.Tensor | None = None  # (batch, 1, S) store slots of each sentence
    step_queries: torch.Tensor | None = None  # (batch, kv_heads, q, head_dim) the last forward's, for `crop`
    before_reset: torch.Tensor | None = None  # query_sum before a sentence end zeroed it, for `crop`

    @classmethod
    def joined(cls, states: list[SentenceLayerState]) -> SentenceLayerState:
        """Rows prefilled apart, laid out as a batch prefilled together: sentences padded to the most (unused
        ids: no tokens, never loaded) before each row's empty sentence, which stays last (`_fill_store`); store
        slots padded to the widest (in the empty sentence, no room: never loaded); the loaded region to the
        largest (its fillers last, `StoreLayer.filler_slot`)."""
        if any(state.sentence_keys is None for state in states):  # kept whole: nothing to pad
            return super().joined(states)
        s = max(state.sentence_sizes.shape[-1] for state in states)
        r = max(state.slot_sentence.shape[-1] for state in states)
        twins = []
        for state in states:
            twin, empty = copy.copy(state), state.sentence_sizes.shape[-1] - 1
            twin.loaded = max(other.loaded for other in states)
            twin.sentence_keys = padded(state.sentence_keys, 2, s, 0, at=empty)
            twin.sentence_sizes = padded(state.sentence_sizes, 2, s, 0, at=empty)
            slot_sentence = state.slot_sentence.masked_fill(state.slot_sentence == empty, s - 1)
            for name, value, fill in (("slot_sentence", slot_sentence, s - 1), ("slot_room", state.slot_room, 0),
                                      ("resident", state.resident, False), ("device_slot", state.device_slot, 0)):
                setattr(twin, name, padded(value, 2, r, fill))
            twins.append(twin)
        return super().joined(twins)


def end_sentence(state, closing: torch.Tensor | None) -> None:
    """Rows `closing` `(batch,)` ended a sentence: their mean query (a layer's `query_sum`, or a stack's) starts
    anew, and the sums before are kept for `crop`. None: no row did."""
    if closing is not None:
        state.before_reset = state.query_sum.clone()  # for `crop`, at sentence ends only
        state.query_sum.masked_fill_(as_rows(closing, state.query_sum), 0.0)  # a new sentence starts


def as_rows(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row flag `(batch,)` shaped to broadcast over `like` `(batch, ...)`, on its device: a mask to fill
    with, where indexing by it would wait for the device to count the rows."""
    return rows.to(like.device).view(-1, *[1] * (like.dim() - 1))
