"""SentenceKV's per-generation state, in one home, the cache's (`cache.state`): each prompt token's sentence, and
the ranking state of every compressed layer (sentence vectors, mean query, which store slots are loaded where),
stacked per device (`LayerStack`) from the moment each layer compresses its prompt."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar, NamedTuple

import torch

from ..state import RowState, padded


@dataclass
class SentenceState(RowState):
    """Per generation: each prompt token's sentence, and the compressed layers' ranking state.

    Attributes:
        sentences: `(batch, prompt)` sentence index of each prompt token, -1 for padding.
        prompt_ids: `(batch, read)` the prompt's tokens read so far (every piece's, generate's
            `prefill_chunk_size`), until `compress` segments them into `sentences`.
        step_ids: `(batch, q)` the last forward's tokens, for `crop`.
        stacks: the compressed layers' ranking state, one `LayerStack` per device (one, unless a `device_map`
            spreads the layers over several).
        closes: `(vocab + 1,)` whether each token id ends a sentence (`sentence_segment.closing_table`), on the
            model's device: a step looks its token up there, reading nothing on the host. Shared by the rows.
    """

    sentences: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    step_ids: torch.Tensor | None = None
    stacks: list[LayerStack] = field(default_factory=list)
    closes: torch.Tensor | None = None

    shared_state: ClassVar[frozenset[str]] = frozenset({"closes"})

    def closing(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Whether each token `(...)` ends a sentence, looked up on the device."""
        return self.closes[token_ids.clamp(max=self.closes.shape[0] - 1)]

    def event_counts(self) -> dict[str, int]:
        totals = [stack.counts.sum(0).tolist() for stack in self.stacks if stack.counts is not None]
        return {kind: sum(t[i] for t in totals) for i, kind in enumerate(LayerStack.COUNTED)} if totals else {}

    def find(self, layer_idx: int) -> tuple[LayerStack, int] | None:
        """The stack holding layer `layer_idx`'s ranking state and its rank there; None for a layer not compressed."""
        for stack in self.stacks:
            if layer_idx in stack.ranks:
                return stack, stack.ranks[layer_idx]
        return None

    def add_layer(self, layer_idx: int, **parts: torch.Tensor) -> tuple[LayerStack, int]:
        """Add a compressed layer's ranking state (the `LayerStack.STACKED` fields, each `(batch, ...)` without the
        layer dimension) to the stack of its device, made on the first; returns the stack and the layer's rank."""
        device = parts["query_sum"].device
        stack = next((s for s in self.stacks if s.query_sum.device == device), None)
        if stack is None:
            stack = LayerStack()
            self.stacks.append(stack)
        return stack, stack.add(layer_idx, parts)


class LayerRanking(NamedTuple):
    """One layer's slice of a `LayerStack` (`LayerStack.at`): its `STACKED` tensors without the layer dimension (a
    named tuple, which a compiled step constructs)."""

    query_sum: torch.Tensor
    sentence_keys: torch.Tensor
    sentence_sizes: torch.Tensor
    slot_sentence: torch.Tensor
    slot_room: torch.Tensor
    resident: torch.Tensor
    device_slot: torch.Tensor


@dataclass
class LayerStack(RowState):
    """The ranking state of the compressed layers on one device, stacked on dim 1 (batch first, then layers), so
    that a step ranks and loads for all of them with one set of ops (`rank_at="step"`), and a layer reads its
    own as a slice (`at`, `rank_at="layer"`). Each layer adds its own when it compresses the prompt (`add`).

    A layer's sentences are numbered from 0, the ones that kept a token, and the last index is the sentence of
    empty store slots (no tokens, never loaded). Layers keep different counts: every layer's are padded to the
    most, before its empty sentence, which stays last. Every layer has the same store slots R (the budget sets
    them).

    Attributes:
        ranks: layer index -> its index on dim 1, in the order the layers compressed.
        last: the index of the last layer stacked: the step's work for every layer runs after it.
        query_sum: `(batch, layers, kv_heads, 1, head_dim)` float32, the sum of the queries of the sentence being
            generated (eq. 2), each GQA group's query heads together.
        sentence_keys: `(batch, layers, kv_heads, S, head_dim)` each sentence's vector (eq. 1's mean key, or
            `(..., 2 head_dim)` its bounds).
        sentence_sizes: `(batch, layers, 1, S)` stored tokens of each sentence.
        slot_sentence: `(batch, layers, kv_heads, R)` the sentence of each store slot.
        slot_room: `(batch, layers, 1, R)` see `sentence_step.loading_room`.
        resident: `(batch, layers, kv_heads, R)` uint8, 1 for the store slots now loaded: bytes, not bools, since
            inductor's CPU code moves a bool tensor some 50 times slower than a byte one (torch 2.13; a compiled
            step writes this one whole).
        device_slot: `(batch, layers, kv_heads, R)` the working-set slot of each loaded store slot, where loads
            copy only the tokens that enter (found on the host); None where a compiled step finds its loads in
            its graph (`SentencePress.loads_in_graph`): its loaded region holds the resident slots in order of
            position, so that a slot's place is a count of those before it (`sentence_step.load_region`) and is
            never stored.
        step_queries: the last forward's queries, per rank `(batch, kv_heads, q, head_dim)` (kept for `crop`).
        before_reset: `query_sum` before a sentence end zeroed it, for `crop`.
        counts: `(batch, 3)` each row's ranking events (`COUNTED`), counted on the device (`sentence_step.count`).
    """

    ranks: dict[int, int] = field(default_factory=dict)
    last: int = -1
    query_sum: torch.Tensor | None = None
    sentence_keys: torch.Tensor | None = None
    sentence_sizes: torch.Tensor | None = None
    slot_sentence: torch.Tensor | None = None
    slot_room: torch.Tensor | None = None
    resident: torch.Tensor | None = None
    device_slot: torch.Tensor | None = None
    step_queries: list = field(default_factory=list)
    before_reset: torch.Tensor | None = None
    counts: torch.Tensor | None = None

    COUNTED: ClassVar[tuple[str, ...]] = ("selections", "loads", "loaded_tokens")
    STACKED: ClassVar[tuple[str, ...]] = LayerRanking._fields

    def add(self, layer_idx: int, parts: dict[str, torch.Tensor]) -> int:
        """Stack one layer's `parts` after the others (its sentences, or theirs, padded to the most); its rank.
        A layer at a time, at its compress: the stack is copied once per layer then, never while decoding."""
        parts = {name: None if t is None else t.unsqueeze(1) for name, t in parts.items()}
        rank = self.ranks[layer_idx] = len(self.ranks)
        self.last = layer_idx
        if self.query_sum is not None:
            s = max(self.sentence_keys.shape[3], parts["sentence_keys"].shape[3])
            parts = vars(widened(SimpleNamespace(**parts), s))
            widened(self, s)
        for name in self.STACKED:
            mine = getattr(self, name)
            setattr(self, name, parts[name] if mine is None or parts[name] is None else
                    torch.cat([mine, parts[name]], dim=1))
        self.step_queries = [None] * len(self.ranks)
        if self.counts is None:
            self.counts = torch.zeros(self.query_sum.shape[0], len(self.COUNTED), dtype=torch.long,
                                      device=self.query_sum.device)
        return rank

    def at(self, rank: int) -> LayerRanking:
        """One layer's ranking state: views of its slice of each stacked tensor (writes go to the stack)."""
        stacked = (getattr(self, name) for name in self.STACKED)
        return LayerRanking(*(None if t is None else t[:, rank] for t in stacked))

    @classmethod
    def joined(cls, stacks: list[LayerStack]) -> LayerStack:
        """Rows prefilled apart, laid out as a batch prefilled together: sentences padded to the most (before the
        empty one, which stays last), store slots to the widest (in the empty sentence, no room: never loaded)."""
        s = max(stack.sentence_keys.shape[3] for stack in stacks)
        r = max(stack.slot_sentence.shape[3] for stack in stacks)
        twins = []
        for stack in stacks:
            twin = widened(LayerStack(**vars(stack)), s)
            for name, fill in (("slot_sentence", s - 1), ("slot_room", 0), ("resident", False), ("device_slot", 0)):
                if getattr(twin, name) is not None:
                    setattr(twin, name, padded(getattr(twin, name), 3, r, fill))
            twins.append(twin)
        return super().joined(twins)


def widened(state, s: int):
    """`state`'s stacked sentences (`(batch, layers, ..., S, ...)`) padded to `s` before the empty one, which
    stays last (the store slots of the empty sentence follow it). In place; returns `state`."""
    empty = state.sentence_keys.shape[3] - 1
    if empty + 1 < s:
        state.sentence_keys = padded(state.sentence_keys, 3, s, 0, at=empty)
        state.sentence_sizes = padded(state.sentence_sizes, 3, s, 0, at=empty)
        state.slot_sentence = state.slot_sentence.masked_fill(state.slot_sentence == empty, s - 1)
    return state


def end_sentence(stack: LayerStack, closing: torch.Tensor) -> None:
    """Rows `closing` `(batch,)` ended a sentence: their mean query starts anew, and the sums before are kept for
    `crop`. (At every step, whether a row closed or not: which did is on the device, and the sums are small.)"""
    stack.before_reset = stack.query_sum.clone()
    stack.query_sum.masked_fill_(as_rows(closing, stack.query_sum), 0.0)  # a new sentence starts


def as_rows(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row flag `(batch,)` shaped to broadcast over `like` `(batch, ...)`, on its device: a mask to fill
    with, where indexing by it would wait for the device to count the rows."""
    return rows.to(like.device).view(-1, *[1] * (like.dim() - 1))
