"""Compression while decoding for any scoring press: a long generation held at a budget.

kvpress's `DecodingPress(base_press, compression_interval, target_size)` is `DecodingPress(press, interval=...)`
with the budget given to the wrapped press (`budget=target_size`); its prompt left whole is `compress_prompt=False`,
and its `PrefillDecodingPress` of one press for both phases is the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from ..attention import attention_probs, query_groups
from ..context import Context
from ..options import check_number
from ..press import ScorerPress
from ..state import RowState
from .pyramidkv import PyramidKVPress


@dataclass
class RecentQueries(RowState):
    """Per generation: each layer's queries of its newest tokens, as its attention used them (rotated), their
    `(cos, sin)` and positions, the newest last: `queries[i]` `(batch, heads, n, head_dim)`, `rope[i]` a pair of
    `(batch, n, rotated dims)` or None, `positions[i]` `(batch, n)`; `inner`, the wrapped press's own state."""

    queries: dict[int, torch.Tensor]
    rope: dict[int, tuple[torch.Tensor, torch.Tensor] | None]
    positions: dict[int, torch.Tensor]
    inner: Any = None


@dataclass
class DecodingPress(ScorerPress):
    """Hold each row at its budget while decoding, with any scoring press: every `interval` decoding steps, the
    tokens a row holds (what its prompt kept and what it generated since) are scored by the wrapped press, with the
    queries of the newest tokens standing for its window, and the row is cut back to its budget.

    A row grows to `interval - 1` tokens past its budget, so the cache holds at most `budget + interval - 1`
    tokens a row however long the generation, and attends them all. The scoring reads the queries of the newest
    `max(interval, the press's window)` tokens (SnapKV's observation window, TOVA's last query), which this
    press keeps per layer; the wrapped press sees them as a prompt's last queries over the tokens held, each
    seeing the tokens at or before its own position. Where a press marks its window by slot (SnapKV's newest
    `window_size` slots always kept), the newest slots are the newest tokens: a cut keeps the slots in position
    order and a step's token takes the next.

    Args:
        press: the scoring press (default "snapkv": a registered press's name is made with the wrapper's ratio
            or budget; SnapKV, ChunkKV, Expected Attention, Knorm, KeyDiff, AdaKV over one of them) whose
            `score` ranks the tokens held, and whose budget (`ratio` of each prompt, or `budget` tokens)
            is held. A press that already evicts at every step (H2O, TOVA, StreamingLLM), keeps by a rule of its
            own (SentenceKV, CHESS, KVzip) or by layer budgets (PyramidKV), is refused.
        ratio: the wrapped press's, unless given here, which gives it to it.
        budget: the same, for the wrapped press's budget: kvpress's `target_size`.
        interval: decoding steps between two cuts, at least 1 (default 64; kvpress's `compression_interval`
            defaults to 512 for a 2048-token target: a cut ranks every token held, so a shorter interval costs a
            scoring per `interval` steps and holds fewer tokens past the budget).
        compress_prompt: the prompt is compressed to the budget by the wrapped press as it would be alone (default
            True); False keeps the prompt whole, and the first cut, at the first decoding step, brings it to the
            budget (kvpress's `DecodingPress`, which leaves the prompt to another press).
    """

    press: ScorerPress | str = "snapkv"
    interval: int = 64
    compress_prompt: bool = True
    captures_step_queries = True  # each step's queries join the recent ones (`after_step`)

    def __post_init__(self):
        from .registry import wrapped_press  # (the registry lists this press)

        press = wrapped_press("DecodingPress", self.press, self.ratio, self.budget)
        wrapped = isinstance(press, ScorerPress) and not isinstance(press, DecodingPress)
        keeps_by_score = wrapped and type(press).compress is ScorerPress.compress
        if isinstance(press, PyramidKVPress):  # (its budgets are the prompt's; a cut holds a row's, every layer)
            raise ValueError("DecodingPress: PyramidKVPress's layer budgets are not held while decoding; wrap "
                             "SnapKVPress (PyramidKV's scoring, every layer at the row's budget).")
        if not keeps_by_score or press.scores_steps or press.selects_before_attention or press.reads_logits:
            got = type(press).__name__ if press is not None else "nothing"
            why = "already evicts at every decoding step" if wrapped and press.scores_steps else \
                "keeps by a rule of its own"
            raise ValueError(f"DecodingPress: press must be a scoring press that keeps by its `score` (SnapKVPress, "
                             f"ChunkPress, ExpectedAttentionPress, KnormPress, KeyDiffPress, AdaKVPress); got "
                             f"{got}" + (f", which {why}." if press is not None else "."))
        self.press = press
        self.ratio, self.budget = press.ratio, press.budget
        self.interval = check_number("DecodingPress", "interval", self.interval, integer=True, low=1,
                                     unit="decoding steps")
        if not isinstance(self.compress_prompt, bool):
            raise TypeError(f"DecodingPress: compress_prompt must be True or False; got {self.compress_prompt!r}.")
        for flag in ("reads_input_ids", "reads_step_attention", "reads_prompt_in_pieces", "joins_rows"):
            setattr(self, flag, getattr(press, flag))
        super().__post_init__()

    # --- the prompt: the wrapped press's ------------------------------------------------------------------------
    def new_layer(self, layer_idx: int):
        return self.press.new_layer(layer_idx)

    def new_state(self, cache) -> RecentQueries:
        return RecentQueries({}, {}, {}, self.press.new_state(cache))

    def begin_forward(self, ctx: Context) -> None:
        self.press.begin_forward(Wrapped.of(ctx))

    def read_piece(self, ctx: Context) -> None:
        self.press.read_piece(Wrapped.of(ctx))

    def compress(self, ctx: Context) -> None:
        """The queries of the prompt's window (the wrapped press's `prompt_tail`) are the first recent ones; then
        the wrapped press compresses it."""
        n = ctx.keys.shape[2]
        start = max(n - (self.press.prompt_tail() or 0), 0)  # (what a prompt read in pieces keeps of its queries)
        if start < n:
            self.remember(ctx, ctx.queries(start, n), ctx.rope, ctx.positions[:, 0, start:])
        if self.compress_prompt:
            self.press.compress(Wrapped.of(ctx))

    def prompt_tail(self) -> int | None:
        return self.press.prompt_tail()

    def min_kept(self) -> tuple[int, str]:
        return self.press.min_kept()

    def attended_beside(self) -> int:
        return self.press.attended_beside()

    def prompt_budgets(self, lengths: torch.Tensor) -> torch.Tensor | None:
        return self.press.prompt_budgets(lengths)

    def crop(self, cache, length: int) -> None:
        """A rejected draft's queries leave the recent ones."""
        state = cache.state
        for i, positions in state.positions.items():
            kept = int((positions[0] < length).sum())  # (every row's tokens are at the same positions)
            state.queries[i], state.positions[i] = state.queries[i][:, :, :kept], positions[:, :kept]
            rope = state.rope[i]
            state.rope[i] = None if rope is None else tuple(t[:, :kept] for t in rope)
        self.press.crop(cache, length)

    # --- decoding -----------------------------------------------------------------------------------------------
    def holds_budget_while_decoding(self) -> bool:
        return self.ratio != 1.0

    def eviction_interval(self) -> int:
        return self.interval

    def after_step(self, ctx: Context) -> None:
        """The forward's queries join the layer's recent ones."""
        # (the forward's tokens are the layer's last slots: a cut comes after)
        self.remember(ctx, ctx.queries(), ctx.rope, ctx.positions[:, 0, -ctx.q_len:])

    def recent(self) -> int:
        """Queries kept per layer: the newest `max(interval, the wrapped press's window)` tokens'."""
        return max(self.interval, self.press.prompt_tail() or 1)

    def remember(self, ctx: Context, queries: torch.Tensor, rope, positions: torch.Tensor) -> None:
        """`queries` `(batch, heads, n, head_dim)` of the newest tokens, at `positions` `(batch, n)`, with their
        `rope` (of these tokens, or more before them), join the layer's recent ones."""
        state, i, keep, n = ctx.state, ctx.layer_idx, self.recent(), queries.shape[2]
        rope = None if rope is None else tuple(t[:, -n:].expand(queries.shape[0], -1, -1) for t in rope)  # (per row)
        if i in state.queries:
            queries = torch.cat([state.queries[i], queries], dim=2)
            positions = torch.cat([state.positions[i], positions], dim=1)
            if rope is not None:
                rope = tuple(torch.cat([old, new], dim=1) for old, new in zip(state.rope[i], rope))
        state.queries[i], state.positions[i] = queries[:, :, -keep:], positions[:, -keep:]
        state.rope[i] = None if rope is None else tuple(t[:, -keep:] for t in rope)

    def score_step(self, ctx: Context) -> torch.Tensor:
        """The tokens held, scored by the wrapped press with the recent queries as its prompt's last ones."""
        state, i = ctx.state, ctx.layer_idx
        window = RecentCall(ctx.call.module, ctx.layer, state.queries[i], state.rope[i], state.positions[i])
        return self.press.score(Wrapped(ctx.cache, ctx.layer, window, prompt=True, inner=state.inner,
                                        fresh=True))


class Wrapped(Context):
    """The context the wrapped press sees: its own state (`RecentQueries.inner`); `fresh` (a cut's scoring), its
    prompt work computed anew (what a prompt's replays share is the prompt's, not the tokens held now)."""

    __slots__ = ("inner", "fresh")

    def __init__(self, cache, layer=None, call=None, prompt: bool = False, logits=None, inner=None,
                 fresh: bool = False):
        super().__init__(cache, layer, call, prompt, logits)
        self.inner, self.fresh = inner, fresh

    @classmethod
    def of(cls, ctx: Context) -> Wrapped:
        return cls(ctx.cache, ctx.layer, ctx.call, ctx.prompt, ctx.logits, ctx.state.inner)

    @property
    def state(self) -> Any:
        return self.inner

    @property
    def q_len(self) -> int:
        """At a cut, the recent queries (the tokens a prompt's last queries stand for)."""
        return self.call.q_len if self.fresh else super().q_len

    def prompt_work(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        return compute() if self.fresh else super().prompt_work(key, compute)


class RecentCall:
    """The newest tokens' queries as the last queries of a prompt over the tokens a layer holds: query `j` of
    `n` recent ones stands at slot `slots - n + j` (`offset`), and sees every real token at or before its own
    position (causal by position, not by slot)."""

    hidden_states = input_valid = projected = weights = None

    def __init__(self, module, layer, queries, rope, positions):
        self.module, self.layer, self._queries, self.position_embeddings = module, layer, queries, rope
        self.query_positions = positions
        self.offset = layer.slots - queries.shape[2]

    @property
    def q_len(self) -> int:
        return self._queries.shape[2]

    def queries(self, start: int = 0, end: int | None = None, grouped: bool = False,
                scaled: bool = False) -> torch.Tensor:
        start = max(start, self.offset)  # (a prompt shorter than the press's window: the queries there are)
        q = self._queries[:, :, start - self.offset: None if end is None else end - self.offset]
        if grouped:
            b, h, n, d = q.shape
            q = q.view(b, h // query_groups(self.module), -1, n, d).sum(2)
        return q * self.module.scaling if scaled else q

    def valid(self) -> torch.Tensor:
        b = self._queries.shape[0]
        return torch.ones(b, self.offset + self.q_len, dtype=torch.bool, device=self._queries.device)

    def prefill_probs(self, keys: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """`(batch, kv_heads, group, end - start, slots)`: every slot, the real ones at or before each query's
        position seen."""
        start = max(start, self.offset)
        at = self.query_positions[:, start - self.offset: end - self.offset]  # (batch, q)
        seen = self.layer.valid[:, :, None, :] & (self.layer.positions[:, :, None, :] <= at[:, None, :, None])
        return attention_probs(self.module, self.queries(start, end, scaled=True), keys, seen[:, :, None])
