"""What a press reads at one event of a forward: the `Context` the core hands every phase of a press.

A press never holds a generation's state; the core hands it one `Context` per event, which reads through to the
homes of that state (the cache, the layer, the forward under way) and writes nothing when read. A scoring press
needs the names of its first three groups; presses that keep a store beside their layers (CHESS, SentenceKV)
reach the objects themselves through `cache`, `layer`, `call` and `forward`.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch


class Context:
    """One event of a forward, as a press sees it: the generation, and at a layer's events that layer and its
    attention call.

    Attributes:
        cache: the generation's `SparseCache`.
        layer: the layer's cache (`KVLayer`), None at a forward's first and last events (`begin_forward`,
            `end_forward`).
        call: the layer's `AttentionCall`, None where `layer` is.
        prompt: the event reads a prompt (`compress`, `read_piece`): `attention` is the prompt's, causal.
        logits: at `end_forward`, the forward's next-token logits `(batch, q, vocab)`; None elsewhere.
    """

    __slots__ = ("cache", "layer", "call", "prompt", "logits")

    def __init__(self, cache, layer=None, call=None, prompt: bool = False, logits: torch.Tensor | None = None):
        self.cache, self.layer, self.call, self.prompt, self.logits = cache, layer, call, prompt, logits

    # --- the layer: what it holds, `(batch, kv_heads, slots, ...)` ----------------------------------------------
    @property
    def keys(self) -> torch.Tensor:
        """`(batch, kv_heads, slots, head_dim)`, rotated at their positions (as attention reads them)."""
        return self.layer.keys

    @property
    def values(self) -> torch.Tensor:
        """`(batch, kv_heads, slots, head_dim)`."""
        return self.layer.values

    @property
    def positions(self) -> torch.Tensor:
        """`(batch, kv_heads, slots)` each slot's absolute position in the left-padded input."""
        return self.layer.positions

    @property
    def valid(self) -> torch.Tensor:
        """`(batch, kv_heads, slots)` True where a slot holds a real token (False: padding, or a free slot)."""
        return self.layer.valid

    @property
    def extra(self) -> dict[str, torch.Tensor]:
        """The press's per-slot tensors `(batch, kv_heads, slots)` by name, which follow their slots when the core
        keeps, evicts or reorders them (H2O's received attention): a press makes them at the prompt and writes them
        in place while decoding (a step refuses one replaced, or added, there)."""
        return self.layer.extra

    # --- the attention call: queries and attention on demand ----------------------------------------------------
    @property
    def layer_idx(self) -> int:
        return self.call.module.layer_idx

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's RoPE `(cos, sin)` `(batch, tokens, rotated dims)` of the forward's tokens (of a prompt read
        in pieces: from the prompt's start), as it turned their queries and keys; None for a layer without RoPE."""
        return self.call.position_embeddings

    def queries(self, start: int = 0, end: int | None = None, grouped: bool = False) -> torch.Tensor:
        """Rotated queries of this forward's tokens `start:end` (at the prompt, counted from its start),
        `(batch, heads, tokens, head_dim)`, as the module makes them (no attention run again); `grouped`: summed
        over each KV head's query heads, `(batch, kv_heads, tokens, head_dim)`."""
        return self.call.queries(start, end, grouped)

    def attention(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Softmax attention of this forward's queries `start:end` (negative: counted from the last), float32,
        `(batch, kv_heads, group, queries, keys)`: each KV head's query heads apart.

        At the prompt: over the prompt's keys up to `end` (causal, padding masked, padding queries' rows zero).
        After it: over every slot the layer holds (free slots and padding never attended; a forward's later
        tokens unseen by its earlier ones): the weights the layer's attention computed, under a press that
        declares it reads them (`Press.reads_step_attention`), else computed again from the queries.
        """
        layer = self.layer
        total = layer.keys.shape[-2] if self.prompt else self.cache.forward.q_len  # the prompt's, or the forward's
        start, end = _index(start, total), total if end is None else _index(end, total)
        if self.prompt:
            return self.call.prefill_probs(layer.keys, start, end)
        weights = self.call.weights  # (batch, heads, q, slots): the attention's own, kept (`keeps_weights`)
        if weights is not None:
            b, h_kv = layer.keys.shape[:2]
            return weights.view(b, h_kv, -1, *weights.shape[-2:])[..., start:end, :]
        q_len = total
        visible = None if q_len == 1 and layer.all_valid else layer.valid[:, :, None, :]  # (b, h, 1, slots)
        if q_len > 1:  # the forward's tokens are its last slots, each seeing none after its own
            n = layer.keys.shape[-2]
            new = torch.arange(n - q_len + start, n - q_len + end, device=layer.keys.device)
            visible = visible & (torch.arange(n, device=new.device) <= new[:, None])
        return self.call.probs(layer.keys, visible, start, end)

    # --- the generation -----------------------------------------------------------------------------------------
    @property
    def budgets(self) -> torch.Tensor | None:
        """`(batch,)` tokens each row keeps, on the layer's device (`Press.prompt_budgets`, set once the prompt
        is in); None for a press that keeps no number of tokens."""
        return None if self.cache.budgets is None else self._row_tensor("budgets")

    @property
    def prompt_start(self) -> torch.Tensor:
        """`(batch,)` each row's first real token (its left padding's length), on the layer's device."""
        return self._row_tensor("prompt_start")

    def _row_tensor(self, name: str) -> torch.Tensor:
        """The cache's row tensor `name` on the layer's device (the CPU at a forward's first and last events)."""
        return self.cache.on(name, self.layer.device if self.layer is not None else "cpu")

    @property
    def q_len(self) -> int:
        """Tokens in this forward (at a prompt read in pieces, this piece's)."""
        return self.cache.forward.q_len

    @property
    def state(self) -> Any:
        """The press's per-generation state (`Press.new_state`), a `RowState` or None."""
        return self.cache.state

    @property
    def plan(self) -> Any:
        """What the press made once for every layer of this forward, at the first layer that needs it; None until
        it sets one. Gone with the forward."""
        return self.cache.forward.plan

    @plan.setter
    def plan(self, value: Any) -> None:
        self.cache.forward.plan = value

    def prompt_work(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """`compute()`, or its result for the same `key` on the same prompt when one is at hand: a press wraps work
        that depends only on the prompt and on what `key` names (never on the budget), so that a `Prefill` replayed
        under several presses or ratios does it once. The result is shared: do not modify it in place."""
        shared = self.cache.shared
        if shared is None:
            return compute()
        if key not in shared:
            shared[key] = compute()
        return shared[key]

    # --- the objects themselves, for presses that keep a store --------------------------------------------------
    @property
    def forward(self):
        """The `Forward` under way (its `input_ids`, `input_valid`, `continues_prompt`)."""
        return self.cache.forward


def _index(i: int, total: int) -> int:
    return i + total if i < 0 else i


def hold_budget(ctx: Context, score: Callable[[], torch.Tensor], by_position: bool = False,
                every: int | None = None) -> None:
    """The core's eviction after a later forward: the lowest-scored real tokens of `ctx.layer` (`score()`,
    `(batch, kv_heads, slots)`, called only on a layer over its budget) are evicted until each row is back within
    its budget (`KVLayer.hold_budget`; each head within its own where the layer keeps head-wise budgets,
    `KVLayer.budgets`), one per row and head after a decoding step's token. The tokens of a draft
    being verified, or of a forward of several, are never evicted while they fit the budget: a rejected draft can
    be cropped.

    `by_position`: the scores depend on position alone and every layer holds the same positions in the same slots
    (`Press.scores_by_position`), so a decoding step's victims are found at its first layer and serve every layer
    (the forward keeps them): a step scores and searches once, not once a layer.

    `every`: the press's `eviction_interval`; given, a layer is left to grow to `every - 1` slots past its budget,
    and at the next it is cut back to the budget in one gather, its slots in position order (`KVLayer.keep`).
    """
    cache, layer, forward = ctx.cache, ctx.layer, ctx.cache.forward
    own = layer.budgets is not None  # head-wise budgets, the layer's own; else each row's, every layer alike
    budgets, largest = (layer.budgets, layer.largest_budget) if own else (ctx.budgets, cache.largest_budget)
    if layer.slots < largest + (every or 1):  # every row within its budget (and the slack `every` leaves)
        return
    one_a_step = every is None and forward.q_len == 1 and not forward.draft and layer.slots == largest + 1
    if one_a_step and by_position and not own:
        if forward.victims is None:
            forward.victims = layer.victims(score(), budgets)
        victims = forward.victims
        layer.evict(victims if victims.device == layer.device else victims.to(layer.device))  # (a split model)
    else:
        layer.hold_budget(score(), budgets, largest, keep_new=forward.q_len > 1 or forward.draft,
                          gather=every is not None)
