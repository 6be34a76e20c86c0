"""The `Press` base class: a KV-cache policy as a dataclass, applied with `with press(model): ...`.

A press is configuration only. Everything one generation needs lives in its `SparseCache` (layers, per-row
budgets, `cache.state`, the `Forward` under way), so a press can be reused and two generations never share state.

A press scores, or selects; the core keeps. The cache's driver calls a press's phases while a forward runs
(`sparsekv.cache` lists a forward's events in order), each with one `sparsekv.context.Context`, what the press may
read of that event; a press overrides the ones its method needs, and every default does nothing. The two that
carry a scoring press's idea return scores, and the core keeps by them: `score` (`ScorerPress`: the prompt's
tokens, of which each row and head keeps its top budget) and `score_step` (a later forward's slots, of which a row
over its budget evicts the lowest). `Press` declares the phases in the order they are called, after its two
factories (`new_layer`, `new_state`); then what a press declares to the driver, and the helpers presses call.
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .cache import SparseCache
from .context import Context
from .generation import COMPILING
from .hooks import install
from .layers import KVLayer
from .log import say_once
from .options import check_arguments, check_number
from .state import RowState


@dataclass
class Press:
    """Base of every press.

    Args:
        ratio: fraction of each prompt's KV kept, in (0, 1], rounded to tokens, and never fewer than the press
            always keeps (`row_budgets`): on a short prompt it keeps more than `ratio`, and a prompt no longer than
            that is kept whole. 1.0 keeps everything, decoding included (no compression).
        budget: tokens of each prompt's KV kept (an alternative to `ratio`; give exactly one). A prompt no longer
            than the budget is kept whole; a press that evicts while decoding holds the budget once it is reached.
        compile: generate compiles the decoding steps (`torch.compile`; CUDA graphs on a GPU) inside the `with`
            block, with no cache or `compile_config` to pass: generate makes a cache of fixed shapes with room for
            its `max_new_tokens`, and compiles with transformers' default `CompileConfig` (on a CPU too) unless
            given one. Default False: decoding runs eagerly (a first compiled step takes seconds to a minute, and
            each budget and batch size gets graphs of its own; docs/compiled.md). For presses whose steps compile
            (`compiled_decoding`).

    Capabilities (class attributes; what the driver does for the press):
        reads_input_ids: `begin_forward` reads token ids (a forward given embeddings is refused).
        scores_by_position: `score_step` depends on positions alone and every layer holds the same positions in
            the same slots (StreamingLLM's): a decoding step's victims are found at its first layer, for all.
        captures_step_queries: decoding steps keep each layer's query projection (`call.projected`), so that
            `call.queries()` shapes it instead of projecting again. Implied by an `on_queries` override.
        reads_step_attention: `ctx.attention()` after the prompt (in `after_step` or `score_step`) reads the
            weights the layer's attention computed, not computed again: inside the `with` block the model's
            attention runs in an implementation that keeps them at those forwards (`attention.sparsekv_implementation`,
            over sdpa or eager; with flash attention they are computed again).
        reads_prompt_in_pieces: a prompt given in several forwards (generate's `prefill_chunk_size`) is read
            as a prompt and continued prompts, with no help from the driver (CHESS, which keeps every token).
            Otherwise `prompt_tail()` says whether the driver can compress such a prompt at its last piece; when
            it cannot, the generation is refused.
        joins_rows: caches of prompts prefilled apart can be joined into one batch (`SparseCache.join`,
            `sparsekv.prefill_rows`): every piece of its state is per row, laid out alike in every row's cache
            or padded to the widest by its state's `joined` (SentenceKV's stores and sentences).
        compiled_decoding: generate may compile the decoding steps (`compile_config`, over a cache made by
            `make_cache(model, compiled=True)`): a step keeps every shape (its token takes a free slot or an
            evicted token's, `holds_budget_while_decoding`), writes in place and reads nothing on the host.
    """

    # Keyword-only, so a press may take a positional argument of its own (SentencePress's tokenizer).
    ratio: float | None = field(default=None, kw_only=True)
    budget: int | None = field(default=None, kw_only=True)
    # How generate decodes, not what the press keeps: not in its repr, nor in its equality (a cache continues).
    compile: bool = field(default=False, kw_only=True, repr=False, compare=False)
    # Options of a press that set its budget instead of ratio / budget (e.g. CHESS's preset).
    budget_options: ClassVar[tuple[str, ...]] = ()
    reads_input_ids: ClassVar[bool] = False
    scores_by_position: ClassVar[bool] = False
    captures_step_queries: ClassVar[bool] = False
    reads_step_attention: ClassVar[bool] = False
    # Derived from the overrides (`__init_subclass__`), for the driver: whether it calls these four phases.
    selects_before_attention: ClassVar[bool] = False
    reads_step_queries: ClassVar[bool] = False
    scores_steps: ClassVar[bool] = False
    reads_logits: ClassVar[bool] = False
    reads_prompt_again: ClassVar[bool] = False
    reads_prompt_in_pieces: ClassVar[bool] = False
    joins_rows: ClassVar[bool] = False
    compiled_decoding: ClassVar[bool] = False

    def __new__(cls, *args, **kwargs):
        """Refuse the common slips before the dataclass's own `__init__` does, with what to write instead."""
        check_arguments(cls, args, kwargs)
        return super().__new__(cls)

    def __enter__(self):
        name = type(self).__name__
        raise TypeError(f"{name}: a press is applied to a model, `with {name}(...)(model):` (the press, called with "
                        "the model); not `with press:`.")

    def __exit__(self, *exc):  # (`with` looks for both before it calls `__enter__`)
        return None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for method, flag in (("choose", "selects_before_attention"), ("on_queries", "reads_step_queries")):
            derived = getattr(cls, method) is not getattr(Press, method)
            # (declared by hand, as before they were derived)
            if flag in cls.__dict__ and cls.__dict__[flag] != derived:
                raise TypeError(f"{cls.__name__}: {flag} follows from overriding {method}; remove {flag} = "
                                f"{cls.__dict__[flag]}" + (" (to keep the decoding steps' query projections without "
                                "on_queries, declare captures_step_queries = True)." if flag == "reads_step_queries"
                                else ")."))
            setattr(cls, flag, derived)
        cls.captures_step_queries = cls.captures_step_queries or cls.reads_step_queries
        cls.scores_steps = cls.score_step is not Press.score_step
        cls.reads_logits = cls.end_forward is not Press.end_forward
        cls.reads_prompt_again = cls.after_prompt is not Press.after_prompt

    def __post_init__(self):
        name = type(self).__name__
        if (self.ratio is None) == (self.budget is None):
            raise ValueError(
                f"{name}: give exactly one of ratio (fraction of the prompt's KV kept, 0 < ratio <= 1) "
                f"or budget (tokens kept, an integer >= 1); got ratio={self.ratio!r}, budget={self.budget!r}."
            )
        if self.ratio is not None:
            self.ratio = check_number(name, "ratio", self.ratio, low=0, high=1, low_open=True,
                                      unit="fraction of KV kept")
        if self.budget is not None:
            self.budget = check_number(name, "budget", self.budget, integer=True, low=1, unit="tokens kept")
        if not isinstance(self.compile, bool):
            raise TypeError(f"{name}: compile must be True or False; got {self.compile!r}.")
        if self.compile and not self.compiled_decoding:
            raise ValueError(f"{name}: compile=True, but {name}'s decoding steps do not compile yet ({COMPILING} "
                             "do); leave compile off: generate decodes eagerly.")

    @classmethod
    def label(cls) -> str:
        """The method's name in tables: the class name without "Press" unless the class says otherwise."""
        return cls.__dict__.get("paper_name") or cls.__name__.removesuffix("Press")

    def __call__(self, model: torch.nn.Module) -> AbstractContextManager[torch.nn.Module]:
        """Install on `model` for the duration of a `with` block."""
        return install(self, model)

    def make_cache(self, model: torch.nn.Module, compiled: bool = False, max_new_tokens: int | None = None
                   ) -> SparseCache:
        """An empty cache for this press, to pass as `cache` (e.g. to reuse a compressed context).

        Args:
            compiled: generate may compile the decoding steps over it (given a `compile_config`; a press whose
                steps compile, `compiled_decoding`, and a model whose every layer it compresses). Default False:
                generate decodes eagerly, whatever its `compile_config`.
            max_new_tokens: with `compiled`, under a press that keeps every generated token (SnapKV, ChunkKV):
                the most tokens a generation adds after its prompt (generate's `max_new_tokens`), for which each
                layer holds free slots, so that every step keeps its shapes. Required there (no default: too few
                is an error at the step that finds no room, too many costs memory and attention over masked
                slots); not used by a press that holds its budget while decoding (StreamingLLM, H2O).
        """
        if max_new_tokens is not None:
            max_new_tokens = check_number(type(self).__name__, "max_new_tokens", max_new_tokens, integer=True,
                                          low=1, unit="tokens")
        cache = SparseCache(self, model.config, compiled, max_new_tokens)
        if compiled:
            check_compiled(self, cache.layers, max_new_tokens)
        return cache

    # --- factories ----------------------------------------------------------------------------------------------
    def new_layer(self, layer_idx: int) -> KVLayer:
        """The cache layer of full-attention layer `layer_idx`."""
        return KVLayer()

    def new_state(self, cache: SparseCache) -> RowState | None:
        """The press's per-generation state, kept in `cache.state` (never on the press); a `RowState` or None."""
        return None

    # --- phases, in the order the driver calls them -------------------------------------------------------------
    def begin_forward(self, ctx: Context) -> None:
        """Before each model forward (`ctx.forward`, the forward about to run, its token ids in
        `forward.input_ids`; no layer), always eagerly, also when generate compiles the steps: host work, or a
        change of the layers' layout, which the model builds its mask for. Tensor work that every layer of a
        step shares belongs to the first layer that needs it (`ctx.plan`), inside a compiled step's graph."""

    def choose(self, ctx: Context) -> tuple[torch.Tensor, torch.Tensor, bool | None] | None:
        """Before a layer's attention, before its mask: the store slots `(batch, n)` the layer reads in this
        forward (the same for every KV head; a `StoreLayer`'s), which of them are real `(batch, n)`, and whether
        all are (None: not known); None (the default): the layer reads what it holds. The core gathers them: anew,
        or on a compiled cache's decoding step into the layer's tensors of a fixed width (then `n` is the same at
        every step)."""
        return None

    def on_queries(self, ctx: Context) -> None:
        """On forwards after the prompt, once the layer projected its queries, before attention
        (`ctx.queries()` shapes them, no second projection): rewrite what slots hold, never how many there are or
        their validity (the mask was built for them; asserted)."""

    def read_piece(self, ctx: Context) -> None:
        """After a layer's attention over a piece of a prompt read in pieces, before the last piece (whose
        `compress` follows): `ctx.call` holds the piece's queries (`call.offset` on; `prompt_tail` more before
        them). What the press reads of each piece goes to per-slot `layer.extra`, or the press's state."""

    def compress(self, ctx: Context) -> None:
        """After a layer's attention over the prompt: compress it (`ScorerPress` keeps by `score`).
        `ctx.queries()` and `ctx.attention()` rebuild queries and attention rows on demand."""

    def after_step(self, ctx: Context) -> None:
        """After a layer's attention on each forward that follows the prompt (decoding steps), before the core
        evicts by `score_step`: what the press reads of the step (H2O adds the attention each slot received)."""

    def score_step(self, ctx: Context) -> torch.Tensor:
        """Scores of every slot the layer holds after a forward that follows the prompt, `(batch, kv_heads,
        slots)`: the core evicts the lowest-scored real tokens of a row over its budget (one per row and head at a
        decoding step; the press then holds its budget while decoding, `holds_budget_while_decoding`). Called
        only when a row is over its budget. Not overridden: every generated token is kept."""
        raise NotImplementedError

    def end_forward(self, ctx: Context) -> None:
        """After each model forward, with its next-token logits `ctx.logits` `(batch, q, vocab)`."""

    def after_prompt(self, ctx: Context, model: torch.nn.Module) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
        """Once the whole prompt is in (every layer attended it; `ctx.forward` is the prompt's, no layer), before
        any later forward, eagerly: a press that reads the prompt through forwards of its own runs them on `model`
        (without a `SparseCache`, so that no press event fires: KVzip's reconstruction) and returns, per layer
        index, the scores of its slots `(batch, kv_heads, slots)` and the tokens each row and head keeps `(batch,)`
        or `(batch, kv_heads)`: the core keeps by them (`KVLayer.keep`). None: nothing to keep. Not overridden:
        nothing runs."""
        return None

    # --- what the press declares to the driver, and `crop` between forwards ------------------------------------
    def holds_budget_while_decoding(self) -> bool:
        """Whether decoding steps evict to hold each row's budget (a layer then holds at most its budget and a
        step's token). The default: a press that scores its steps (`score_step`) does, unless `ratio=1.0` asked to
        keep everything; another keeps every generated token, and the cache grows."""
        return self.scores_steps and self.ratio != 1.0

    def eviction_interval(self) -> int | None:
        """How a row that holds its budget while decoding evicts: None (the default), one token at every step
        once over its budget, the newest moving into the victim's slot; `k` (`DecodingPress`), a row grows to
        `k - 1` tokens past its budget and at the k-th is cut back to it in one gather that keeps its slots in
        position order, the newest last (so `k = 1` cuts at every step in that order)."""
        return None

    def min_kept(self) -> tuple[int, str]:
        """The press's floor: the fewest tokens a row keeps (its budget is never lower, and a prompt no longer is
        kept whole), and what they are, as the press's options say it (e.g. "window_size=32"). Default: 1 token."""
        return 1, "1 token"

    def prompt_tail(self) -> int | None:
        """For a prompt read in pieces (generate's `prefill_chunk_size`): how many of its last tokens' layer
        inputs `compress` reads (their queries), which the driver keeps from the earlier pieces to compress at
        the last piece as the whole prompt would be (`sparsekv.pieces.PromptPieces`); what it reads of every query goes
        through `read_piece` (H2O). None (the default): the press does not say, and such a generation is
        refused."""
        return None

    def crop(self, cache: SparseCache, length: int) -> None:
        """The tokens at positions `length` and after (the last forward's) are rejected: forget what they added to
        the press's state. The default keeps it: right for state indexed by prompt slot or by row."""

    # --- helpers for presses ------------------------------------------------------------------------------------
    def check_floor(self) -> None:
        """Refuse a `budget` below the press's floor (`min_kept`), naming the options that set it: called at the
        end of a press's `__post_init__`, once its own options are checked."""
        least, what = self.min_kept()
        if self.budget is not None and self.budget < least:
            shown = what if what.endswith(f"={least}") else f"{what} = {least}"
            options = " or ".join(re.findall(r"(\w+)=", what))
            raise ValueError(f"{type(self).__name__}: budget={self.budget} must be at least {shown} (the tokens it "
                             f"always keeps); lower {options} to keep fewer.")

    def prompt_budgets(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """Tokens each row keeps, `(batch,)`, for prompts of `lengths` real tokens: `budget`, or `ratio` of the
        row's prompt (rounded), and never fewer than the tokens the press always keeps (`min_kept`); None for a
        press given neither (CHESS's `read_budget`). The core sets `cache.budgets` from it once the prompt is in."""
        asked = self._asked(lengths)
        return None if asked is None else asked.clamp(min=self.min_kept()[0])

    def _asked(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """The tokens `budget` or `ratio` asks of each row's prompt, before the floor; None when neither is set."""
        if self.budget is not None:
            return torch.full_like(lengths, self.budget)
        return None if self.ratio is None else (lengths.double() * self.ratio).round().long()

    def row_budgets(self, ctx: Context) -> torch.Tensor | None:
        """At the prompt, the tokens each row keeps `(batch,)` (`prompt_budgets`, on the CPU), or None when
        there is nothing to compress: every row's budget, with the tokens the press attends besides it
        (`attended_beside`), covers its prompt (`ctx.budgets` still gives them; `compresses`)."""
        return ctx.cache.budgets if ctx.cache.compresses else None

    def attended_beside(self) -> int:
        """Tokens a row attends at every step besides its budget (SentenceKV's sinks and window): a prompt no
        longer than its budget and these is kept whole. Default 0."""
        return 0

    def compresses(self, lengths: torch.Tensor, budgets: torch.Tensor) -> bool:
        """Whether any row of prompts of `lengths` tokens, keeping `budgets` (`prompt_budgets`), is compressed;
        the core asks once, when it sets the budgets, and `row_budgets` answers from it at every layer.

        A row whose prompt is no longer than its budget and the tokens the press attends besides it cannot be
        compressed: it is kept whole (said once per process through the `sparsekv` logger, unless `ratio=1.0`
        asked for that). Its budget stays what it is: a press that evicts while decoding holds it once the row
        grows past it. A longer row whose `ratio` falls under the floor keeps the floor (said once too).
        """
        minimum, what = self.min_kept()
        beside = self.attended_beside()
        whole = budgets + beside >= lengths
        if self.ratio != 1.0 and bool(whole.any()):
            row = int(lengths.masked_fill(~whole, -1).argmax())
            kept = f"budget={self.budget}" if self.budget is not None and self.budget >= minimum else what
            held = int(budgets[row]) + beside
            every = self.eviction_interval() or 1
            after = " Prompts this short are never compressed." if not self.holds_budget_while_decoding() else \
                f" While decoding it grows to {held} tokens, then evicts one a step." if every == 1 else \
                f" While decoding it grows to {held + every - 1} tokens, then is cut back to {held} every {every} " \
                "steps."
            say_once((type(self), "whole"), (
                f"sparsekv: {type(self).__name__}: a prompt of {int(lengths[row])} tokens"
                f"{f' (row {row})' if len(lengths) > 1 else ''} is kept whole: it is no longer than the "
                f"{held} tokens the press keeps ({kept}{f' and {beside} always attended' if beside else ''})."
                f"{after} (Said once.)"))
        asked = self._asked(lengths)
        raised = (budgets > asked) & ~whole if self.budget is None else None
        if raised is not None and bool(raised.any()):
            row = int(raised.int().argmax())
            say_once((type(self), "floor"), (
                f"sparsekv: {type(self).__name__}: ratio={self.ratio:g} of a prompt of {int(lengths[row])} tokens"
                f"{f' (row {row})' if len(lengths) > 1 else ''} is {int(asked[row])} tokens, under the press's "
                f"floor ({what}): it keeps {int(budgets[row])}. (Said once.)"))
        return not bool(whole.all())


@dataclass
class ScorerPress(Press):
    """A press that scores every prompt token once, at prefill, and the core keeps the best per row and KV head.

    Subclasses implement `score(ctx)`, and `score_step(ctx)` to evict while decoding; the budget, padding and the
    kept layout are the core's.
    """

    joins_rows: ClassVar[bool] = True  # what it keeps is its layers' slots, per row

    def score(self, ctx: Context) -> torch.Tensor:
        """Importance of each prompt token, `(batch, kv_heads, prompt)`; higher is kept first, +inf always."""
        raise NotImplementedError

    def head_budgets(self, ctx: Context, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """The tokens each row keeps on each KV head, from the prompt's `scores` `(batch, kv_heads, prompt)`
        (padding -inf) and the row budgets `(batch,)`: `(batch,)` to keep each row's budget on every head (the
        default), or `(batch, kv_heads)` to share it between the heads (head-wise budgets, as AdaKV does). Each
        head then holds its own number of real tokens; the rest of its slots are fillers it never attends."""
        return budgets

    def compress(self, ctx: Context) -> None:
        budgets = self.row_budgets(ctx)
        if budgets is None:  # every prompt kept whole
            return
        scores = self.score(ctx).masked_fill(~ctx.valid, float("-inf"))  # padding never kept
        ctx.layer.keep(scores, self.head_budgets(ctx, scores, budgets))


def check_compiled(press, layers: list, max_new_tokens: int | None) -> None:
    """Refuse a `compiled` cache that generate could not compile, or whose steps would not keep their shapes."""
    name = type(press).__name__
    if not press.compiled_decoding:
        raise ValueError(f"compiled: {name}'s decoding steps do not compile yet ({COMPILING} do); make its cache "
                         "without compiled=True: generate then decodes eagerly.")
    if max_new_tokens is None and not press.holds_budget_while_decoding():
        raise ValueError(f"max_new_tokens: {name} keeps every generated token, so a compiled cache makes room for "
                         "them after the prompt: give the most a generation adds (generate's max_new_tokens), "
                         "`make_cache(model, compiled=True, max_new_tokens=...)`.")
    if not all(isinstance(layer, KVLayer) for layer in layers):
        raise ValueError(f"compiled: this model mixes in layers {name} does not compress (sliding-window or "
                         "linear attention), which keep transformers' growing cache: generate cannot compile its "
                         "steps; make the cache without compiled=True.")
