"""The `Press` base class: a KV-cache policy as a dataclass, applied with `with press(model): ...`.

A press is configuration only. Everything one generation needs lives in its `SparseCache` (per-layer slots,
per-row budgets, `cache.state`), so a press can be reused and two generations never share state.

What the core asks of a press (override what the method needs; every default does nothing):
- `compress(cache, layer, call)`: after attention on the prompt, choose what the layer keeps.
- `after_step(cache, layer, call)`: after attention on every later forward (decoding): evict, rescore.
- `before_attention(cache, layer, call)`: before attention on every forward: select what to attend.
- `on_queries(cache, layer, call)`: on every forward after the prompt, once the layer projected its queries
  and before attention: select from this step's queries (`call.queries()` is captured there, not recomputed).
- `on_logits(cache, logits)`: after each model forward, with the next-token logits.
- `before_forward(cache, input_ids)`: before each model forward, with its token ids (None for embeddings).
- `new_layer(layer_idx)` / `new_state(cache)`: the layer objects and cross-layer state a generation needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .attention import AttentionCall
from .cache import KVLayer, SparseCache
from .hooks import install


@dataclass
class Press:
    """Base of every press.

    Args:
        ratio: fraction of each prompt's KV kept, in (0, 1]. 1.0 keeps everything (no compression).
        budget: tokens of each prompt's KV kept (an alternative to `ratio`; give exactly one).
    """

    # Keyword-only, so a press may take a positional argument of its own (SentencePress's tokenizer).
    ratio: float | None = field(default=None, kw_only=True)
    budget: int | None = field(default=None, kw_only=True)
    # Options of a press that set its budget instead of ratio / budget (e.g. CHESS's preset).
    budget_options: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        if (self.ratio is None) == (self.budget is None):
            raise ValueError(
                f"{type(self).__name__}: give exactly one of ratio (fraction of the prompt's KV kept, 0 < ratio <= 1) "
                f"or budget (tokens kept, an integer >= 1); got ratio={self.ratio!r}, budget={self.budget!r}."
            )
        if self.ratio is not None and not (isinstance(self.ratio, (int, float)) and 0 < self.ratio <= 1):
            raise ValueError(f"{type(self).__name__}: ratio must be in (0, 1] (fraction of KV kept); "
                             f"got {self.ratio!r}.")
        if self.budget is not None and not (isinstance(self.budget, int) and self.budget >= 1):
            raise ValueError(f"{type(self).__name__}: budget must be an integer >= 1 (tokens kept); "
                             f"got {self.budget!r}.")

    def __call__(self, model: torch.nn.Module):
        """Install on `model` for the duration of a `with` block."""
        return install(self, model)

    def make_cache(self, model: torch.nn.Module) -> SparseCache:
        """An empty cache for this press, to pass as `cache` (e.g. to reuse a compressed context)."""
        return SparseCache(self, model.config)

    # --- extension points -------------------------------------------------------------------------------------
    def new_layer(self, layer_idx: int) -> KVLayer:
        """The cache layer of full-attention layer `layer_idx` (a `KVLayer` subclass for presses with per-layer
        state, e.g. CHESS's page store)."""
        return KVLayer()

    def new_state(self, cache: SparseCache):
        """The press's cross-layer state for one generation, kept in `cache.state` (never on the press)."""
        return None

    def compress(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        """After attention ran over the prompt in `layer`: compress it (`layer.keep` / `select` / `evict`).
        `call` rebuilds queries and attention rows on demand."""

    def after_step(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        """After attention in `layer` on each forward that follows the prompt (decoding steps)."""

    def before_attention(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        """Before attention in `layer` on each decoding step: change what the layer attends (selection presses)."""

    @property
    def selects_before_attention(self) -> bool:
        """Whether the press overrides `before_attention` (the hooks skip building its arguments otherwise)."""
        return type(self).before_attention is not Press.before_attention

    def on_queries(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        """On each forward after the prompt, right after `layer` projected its queries, before attention.

        `call.queries()` shapes the captured projection (no second projection). The attention mask is built by
        then: rewrite what slots hold (keys, values, positions), never how many there are or their validity.
        """

    @property
    def reads_step_queries(self) -> bool:
        """Whether decoding steps capture each layer's query projection for `call.queries()` (in `on_queries`
        and `after_step`). True when `on_queries` is overridden; presses whose `after_step` reads queries say
        so too."""
        return type(self).on_queries is not Press.on_queries

    def on_logits(self, cache: SparseCache, logits: torch.Tensor) -> None:
        """After each model forward, with its next-token `logits` `(batch, q, vocab)` (q may be 1)."""

    def before_forward(self, cache: SparseCache, input_ids: torch.Tensor | None) -> None:
        """Before each model forward, with its token ids (None when the model gets embeddings)."""

    @property
    def reads_input_ids(self) -> bool:
        """Whether the press overrides `before_forward` (it sees each forward's token ids, e.g. to segment)."""
        return type(self).before_forward is not Press.before_forward

    # --- helpers for presses ------------------------------------------------------------------------------------
    def row_budgets(self, cache: SparseCache, minimum: int = 1, what: str = "1 token") -> torch.Tensor:
        """Tokens each row keeps, `(batch,)`, from `ratio` or `budget`; set once per generation on the cache.

        `minimum` tokens (described by `what`, e.g. "window_size=32") are what the press cannot do without:
        a prompt or a budget smaller than that raises.
        """
        if cache.budgets is None:
            name, lengths = type(self).__name__, cache.prompt_lengths
            shortest = int(lengths.min())
            if shortest < minimum:
                raise ValueError(f"{name}: the prompt ({shortest} tokens) is shorter than {what}; use a longer prompt.")
            if self.budget is not None:
                if self.budget > shortest:
                    raise ValueError(
                        f"{name}: budget={self.budget} is larger than the prompt ({shortest} tokens); "
                        "budget must be at most the prompt length."
                    )
                budgets = torch.full_like(lengths, self.budget)
            else:
                budgets = (lengths.double() * self.ratio).round().long().clamp(min=1)
            if int(budgets.min()) < minimum:
                asked = f"budget={self.budget}" if self.budget is not None else f"ratio={self.ratio}"
                raise ValueError(
                    f"{name}: {asked} keeps {int(budgets.min())} tokens of a {int(lengths[budgets.argmin()])}-token "
                    f"prompt, fewer than the {minimum} it always keeps ({what}); raise the ratio or budget."
                )
            cache.budgets = budgets
        return cache.budgets

    @staticmethod
    def keeps_everything(cache: SparseCache) -> bool:
        return bool((cache.budgets >= cache.prompt_lengths).all())

    @staticmethod
    def hold_budget(cache: SparseCache, layer: KVLayer, scores: torch.Tensor) -> None:
        """Evict the lowest-`scores` real tokens until each row is back within its budget.

        One new token (decoding) costs an in-place move of one slot; several (a continued prompt) a gather.
        """
        if layer.slots <= int(cache.budgets.max()):
            return
        if layer.slots == int(cache.budgets.max()) + 1:
            layer.evict(scores.masked_fill(~layer.valid[:, None, :], float("inf")).argmin(dim=-1))
        else:
            layer.keep(scores.masked_fill(~layer.valid[:, None, :], float("-inf")), cache.budgets)


@dataclass
class ScorerPress(Press):
    """A press that scores every prompt token once, at prefill, and keeps the best per KV head.

    Subclasses implement `score()`; the budget, padding and the kept layout are handled here.
    """

    def score(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> torch.Tensor:
        """Importance of each prompt token, `(batch, kv_heads, prompt)`; higher is kept first, +inf always."""
        raise NotImplementedError

    def min_kept(self) -> tuple[int, str]:
        """Tokens the press always keeps (so the smallest budget it accepts), and what they are."""
        return 1, "1 token"

    def compress(self, cache, layer, call):
        budgets = self.row_budgets(cache, *self.min_kept())
        if self.keeps_everything(cache):
            return
        scores = self.score(cache, layer, call)
        scores = scores.masked_fill(~call.valid()[:, None, :], float("-inf"))
        layer.keep(scores, budgets)
