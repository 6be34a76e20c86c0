"""The sparsekv cache, and the one driver of what a press does during a forward.

`SparseCache` is a transformers `Cache` whose full-attention layers are a press's `KVLayer`s (other layer types,
e.g. Gemma3's sliding ones, keep transformers' own). Everything one generation needs lives in it: the layers,
per-row prompt lengths and budgets, the press's state (`state`) and, while a forward runs, that forward's
`Forward`. So one press object serves any number of generations, concurrent ones included.

The order of events of one model forward, in one place (the hooks call these methods, `Prefill` calls the same);
each hands the press one `Context` (`sparsekv.context`), made once per layer and forward:

1. `begin_forward`: a new `Forward` (its token ids, which tokens are real); at the first forward, each row's
   prompt length and start; the press's `begin_forward` (e.g. SentenceKV keeps the prompt's ids). Host work
   only, run eagerly before the model (the hooks keep it out of a compiled step's graph,
   `hooks._before_model`): a compiled step is then one graph, guarded once.
2. For each compressed layer, `before_layer`, before its attention: the store slots the press's `choose` says
   the layer reads, gathered by the core (CHESS's planned working set), then the mask for the layer's physical
   layout.
3. `after_queries`, once the layer projected its queries (forwards after the prompt, presses that read them):
   the press's `on_queries` (SentenceKV loads sentences); the layout the mask was built for may not change.
4. transformers calls `update` (new tokens appended), and attention runs.
5. `after_layer`, after its attention: the press's `compress` (the prompt), or its `after_step` and then the
   core's eviction by its `score_step` where a row is over its budget (later forwards).
6. `after_head`, at the model's output head, with its logits (presses that read them): the press's
   `end_forward` (CHESS's uncertainty trigger and selection), inside the forward, so that a compiled step's one
   graph holds it.
7. `end_forward`, after the model: the press given the logits if no output head gave them; after the prompt,
   the press's `after_prompt` with the model (KVzip's reconstruction forwards), and layers whose heads hold
   different numbers of tokens moved into lanes (`sparsekv.lanes`); then the `Forward` is closed. Host work only.

Batch operations (`reorder_cache` for beam search, `batch_select_indices`, `batch_repeat_interleave`:
`sparsekv.rows`), `crop`, `reset` and `deepcopy` (`sparsekv.copies`) are written once over `RowState`s
(`sparsekv.state`), for every press.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import nullcontext
from typing import Any

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from .architectures import COMPRESSED_LAYER_TYPES, rotary
from .attention import AttentionCall, module_implementation, query_groups, reads_lanes
from .buffers import step_state
from .context import Context, hold_budget
from .copies import CacheCopies, _load_cache  # noqa: F401 (pickles made before name it here)
from .forward import Forward, check_inputs
from .join import join_caches
from .lanes import pack_layers
from .layers import KVLayer
from .masks import check_left_padded, padding_mask, physical_mask, step_layouts
from .pieces import PromptPieces
from .rows import CacheRows
from .state import RowState
from .stats import CacheStats, cache_stats, clock, prompt_kept

# `before_layer`'s answer when the layer keeps transformers' mask (its layout is the logical one).
KEEP_MASK = object()


class SparseCache(CacheCopies, CacheRows, RowState, Cache):
    """A transformers `Cache` whose full-attention layers are the press's `KVLayer`s; the driver of a forward.

    Attributes:
        press: the press (configuration only, shared by copies).
        prompt_lengths: `(batch,)` real prompt tokens, on the CPU; `prompt_start`: `(batch,)` each row's first
            real token. Set at the first forward.
        budgets: `(batch,)` tokens kept per row, set once the prompt is in (`Press.prompt_budgets`); None before,
            and for a press that keeps no number of tokens (CHESS's `read_budget`). `compresses`: whether any row
            is compressed under them (`Press.compresses`: the others are kept whole).
        state: the press's per-generation state (`Press.new_state`), a `RowState` or None.
        compiled: generate may compile its decoding steps over this cache (`is_compileable`; `Press.make_cache`).
        max_new_tokens: a `compiled` cache's room for the tokens each generation adds after its prompt, under a
            press that keeps them all (`Press.holds_budget_while_decoding` False); None otherwise.
        forward: the `Forward` under way, None between forwards.
        layouts: per compressed layer's index, the index of the first compressed layer that holds the same
            validity on the same device, its layout's (a compiled cache's layers after its prompt, under every
            press whose steps compile, `ready_for_steps`; empty before, and after a crop): a decoding step builds
            one mask for the layers of a layout and finds one free slot for its token (`Forward.masks`,
            `Forward.step_slots`), not one per layer. Under most presses every layer holds one layout
            (`one_layout`); under ChunkKV, each set of layers whose chunks hold as many tokens. A step keeps them
            so: its token takes a free slot found from that validity, or a real token's slot.
        seconds: time spent in press work, "compress" and "step" (for `stats`); counts: press events by kind.
    """

    shared_state = frozenset({"layers", "press", "config", "forward", "shared", "seconds", "counts"})

    def __init__(self, press, config, compiled: bool = False, max_new_tokens: int | None = None):
        text_config = config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(text_config)
        layers = [
            press.new_layer(i) if t in COMPRESSED_LAYER_TYPES else DYNAMIC_LAYER_TYPE_MAPPING[t](**kw)
            for i, (t, kw) in enumerate(zip(types, kwargs))
        ]
        super().__init__(layers=layers)
        self.press, self.config, self.compiled, self.max_new_tokens = press, config, compiled, max_new_tokens
        self.forward: Forward | None = None
        self.pieces: PromptPieces | None = None  # a prompt read in pieces, until its last
        self.prompt_lengths: torch.Tensor | None = None
        self.prompt_start: torch.Tensor | None = None
        self.budgets: torch.Tensor | None = None
        self.compresses = False
        self.layouts: dict[int, int] = {}
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.shared: dict | None = None  # prompt-only results of replays of one Prefill (`Context.prompt_work`)
        self._copies: dict[tuple, tuple] = {}  # per value of a row tensor: `on`, `largest_budget`
        self.state = press.new_state(self)

    @property
    def is_compileable(self) -> bool:
        """generate compiles its decoding steps over a `compiled` cache (given a `compile_config`), and gives
        its forwards 4D masks (`masks.padding_mask`)."""
        return self.compiled

    def on(self, name: str, device: torch.device | str) -> torch.Tensor:
        """The row tensor `name` ("prompt_start", "prompt_lengths" or "budgets": CPU tensors, read on the host)
        on `device`, copied there once per value and device: a decoding step then copies nothing to a GPU (a copy
        from pageable host memory waits for the device, a synchronisation). A new value (a reordered batch, a
        reset) is a new tensor, so its copy is made anew."""
        source, device = getattr(self, name), torch.device(device)
        if source.device == device:
            return source
        copy_ = self._copies.get((name, device))
        if copy_ is None or copy_[0] is not source:
            copy_ = self._copies[(name, device)] = (source, source.to(device))
        return copy_[1]

    @property
    def one_layout(self) -> bool:
        """Every compressed layer holds one layout (`layouts`): a decoding step builds one mask for all."""
        return bool(self.layouts) and len(set(self.layouts.values())) == 1

    @property
    def largest_budget(self) -> int:
        """The largest row budget (`budgets` set), read once per value: presses compare slot counts with it at
        every layer of every step, and a reduction of even a CPU tensor is an op to dispatch."""
        cached = self._copies.get(("largest_budget", None))
        if cached is None or cached[0] is not self.budgets:
            cached = self._copies[("largest_budget", None)] = (self.budgets, int(self.budgets.max()))
        return cached[1]

    @classmethod
    def join(cls, caches: list[SparseCache], consume: bool = False) -> SparseCache:
        """The rows of `caches` in one cache, in order, as if prefilled together (`sparsekv.join.join_caches`)."""
        return join_caches(caches, consume)

    def compressed_layers(self) -> list[KVLayer]:
        return [layer for layer in self.layers if isinstance(layer, KVLayer)]

    # --- the driver: one forward's events, in order ----------------------------------------------------------
    def begin_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, q_len: int,
                      batch: int, draft: bool = False, pieces_left: int = 0) -> None:
        """Open a forward of `q_len` tokens per row; the 2D `attention_mask` tells which are real; `draft`: the
        tokens are a draft being verified (assisted decoding, prompt lookup), not a continued prompt;
        `pieces_left`: the forward is a piece of a prompt read in pieces, and this many follow it (generate's
        `prefill_chunk_size`; only for presses with a `prompt_tail`). A 4D mask: `padding_mask`."""
        valid = None  # None: every new token is real (the common case, and the fast path)
        first, piece = self.prompt_lengths is None, self.pieces is not None
        unreadable = isinstance(attention_mask, dict) or getattr(attention_mask, "ndim", None) == 4
        check_inputs(self, input_ids, unreadable, q_len, batch, first, piece)
        attention_mask = padding_mask(attention_mask, first, q_len)
        if attention_mask is not None:
            valid = attention_mask[:, -q_len:].bool()
            valid = None if bool(valid.all()) else valid
            if valid is not None:
                check_left_padded(attention_mask)
        self.forward = Forward(input_ids, valid, q_len, first=first, draft=draft, pieces_left=pieces_left,
                               continues_prompt=not first and not piece and q_len > 1 and not draft,
                               own_masks=unreadable and not first and q_len > 1)
        if first and pieces_left:
            self.pieces = PromptPieces(self.press.prompt_tail())
        if first or piece:
            real = valid if valid is not None else torch.ones(batch, q_len, dtype=torch.bool)
            lengths = real.sum(-1).cpu()
            self.prompt_lengths = lengths if first else self.prompt_lengths + lengths
            empty = self.prompt_lengths == 0
            if not pieces_left and bool(empty.any()):
                raise ValueError(f"attention_mask: row {int(empty.int().argmax())} of the batch is only padding (no "
                                 "real token); a press keeps a budget of each row's real tokens: drop the row from the "
                                 "batch, or give it at least one token.")
            if self.pieces is not None:
                self.pieces.read(real)
            seen = self.pieces.length if self.pieces is not None else q_len
            self.prompt_start = (seen - self.prompt_lengths).clamp(min=0)  # left padding: before the first piece
            if not pieces_left:  # the whole prompt is in
                self.budgets = self.press.prompt_budgets(self.prompt_lengths)
                self.compresses = self.budgets is not None and self.press.compresses(self.prompt_lengths,
                                                                                      self.budgets)
        start = clock()
        self.press.begin_forward(Context(self))  # host work before the model runs (never compiled)
        self.timed("compress" if first else "step", start)

    def before_layer(self, module: torch.nn.Module, hidden: torch.Tensor,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
        """Before layer `module.layer_idx`'s attention: the press's selection, then the mask (or `KEEP_MASK`)."""
        forward = self._open_forward(module.layer_idx)
        layer = self.layers[module.layer_idx]
        if not rotary(module):  # the module leaves its queries and keys as they are (a NoPE layer)
            position_embeddings = None
        call = AttentionCall(module, hidden, position_embeddings, forward.input_valid)
        call.capture = self.press.captures_step_queries and not forward.first  # after the prompt
        ctx = forward.contexts[module.layer_idx] = Context(self, layer, call)
        self._gather_chosen(ctx, in_place=self.compiled and forward.q_len == 1 and not forward.first)
        if not layer.compressed and not forward.own_masks:
            return KEEP_MASK
        # (the config is read only when needed: its attribute reads are slow, and this runs at every layer and step)
        if forward.input_valid is None and layer.all_valid and (
                forward.q_len == 1 or module_implementation(module).startswith("flash")):
            return None  # every slot real, nothing causal to mask: the fast path
        new_valid = forward.input_valid
        layout = self.layouts.get(module.layer_idx) if forward.q_len == 1 else None
        if layout in forward.masks:  # built by the step's first layer of this layout, for all of them
            return forward.masks[layout]
        if new_valid is None:
            new_valid = torch.ones(hidden.shape[:2], dtype=torch.bool, device=layer.valid.device)
        past = layer.valid  # (compiling, a view of its buffer made in the graph: `StepViews.tensor`)
        mask = physical_mask(past[:, 0] if layer.heads_agree else past, new_valid, module_implementation(module),
                             hidden.dtype, query_groups(module))
        if layout is not None:
            forward.masks[layout] = mask
        return mask

    def after_queries(self, layer_idx: int, projected: torch.Tensor) -> None:
        """The layer's query projection ran: presses that read a step's queries get them (`on_queries`)."""
        ctx = self.forward.contexts.get(layer_idx) if self.forward is not None else None
        if ctx is None or not ctx.call.capture or ctx.call.projected is not None:  # not captured, or a press's
            return  # own projection (run from `on_queries` itself)
        ctx.call.projected = projected
        if not self.press.reads_step_queries:  # kept for `ctx.queries()` only
            return
        layer = ctx.layer
        slots, views, valid = layer.slots, layer._views, layer._valid  # (its step views, or its own validity)
        self.press.on_queries(ctx)
        if layer.slots != slots or layer._views is not views or layer._valid is not valid:  # (the mask's layout)
            raise RuntimeError(f"{type(self.press).__name__}.on_queries changed layer {layer_idx}'s slots or their "
                               "validity after its mask was built; rewrite what slots hold, not how many there are.")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        forward = self._open_forward(layer_idx)
        kwargs.setdefault("valid", forward.input_valid)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def keeps_weights(self) -> bool:
        """Whether the forward's attention keeps its weights for the press (`attention.sparsekv_implementation`): after
        the prompt, under a press that reads them (`Press.reads_step_attention`)."""
        return self.press.reads_step_attention and not self.forward.first and self.pieces is None

    def after_layer(self, layer_idx: int, weights: torch.Tensor | None = None) -> None:
        """After the layer's attention (`weights`: its softmax weights, when it kept them, `keeps_weights`): the
        press compresses the prompt, or does its per-step work; timed."""
        ctx = self.forward.contexts.pop(layer_idx)
        ctx.call.weights = weights
        layer, press = ctx.layer, self.press
        start, kind = clock(), "compress"
        if self.pieces is not None:  # a prompt read in pieces: compressed at its last, as a whole
            ctx.call, ctx.prompt = self.pieces.call(ctx.call), True
            if self.forward.pieces_left:
                press.read_piece(ctx)
            else:
                press.compress(ctx)
        elif self.forward.first:  # the prompt
            ctx.prompt = True
            press.compress(ctx)
        else:
            press.after_step(ctx)
            holds = press.holds_budget_while_decoding()
            if holds and press.scores_steps:  # a row over its budget evicts its lowest-scored tokens
                hold_budget(ctx, lambda: press.score_step(ctx), press.scores_by_position, press.eviction_interval())
            if self.compiled and not holds:
                # The step's token to a free slot: the layer keeps its shape. The slot its layout's first layer
                # found, where it has one (`layouts`).
                layout = self.layouts.get(layer_idx)
                slot = layer.keep_step_token(self.forward.step_slots.get(layout))
                if layout is not None and slot is not None:
                    self.forward.step_slots[layout] = slot
            kind = "step"
        self.timed(kind, start)

    def timed(self, kind: str, start: float | None) -> None:
        """Add the seconds since `start` (`clock()`) to `seconds[kind]`; nothing when it was not taken."""
        if start is not None:
            self.seconds[kind] += time.perf_counter() - start

    def after_head(self, logits: torch.Tensor) -> None:
        """At the model's output head, inside its forward (a compiled step's graph holds it): the press's
        `end_forward` with the forward's next-token `logits` `(batch, q, vocab)`, once a forward."""
        if self.forward is None or self.forward.logits_read:
            return
        self.forward.logits_read = True  # (before the press: see `CHESSPress.end_forward`)
        self.press.end_forward(Context(self, logits=logits))

    def end_forward(self, logits: torch.Tensor | None, model: torch.nn.Module | None = None) -> None:
        """After the model, with its next-token `logits` `(batch, q, vocab)` (None if it returned none): the
        press's `end_forward` if the output head did not give them (`after_head`); at the prompt's end, its
        `after_prompt` with the `model` that ran it; then the forward closes."""
        if logits is not None and self.press.reads_logits:
            self.after_head(logits)
        prompt_in = (self.forward.first or self.pieces is not None) and not self.forward.pieces_left
        if self.press.reads_prompt_again and prompt_in:
            if model is None:
                raise ValueError(f"model: {type(self.press).__name__} runs the model again once the prompt is in; "
                                 "give end_forward the model.")
            from .hooks import installed  # (the hooks import this module)

            start = clock()
            # Its forwards' layer events reach it through the press's hooks (`sparsekv.probe`): installed for them
            # where the press is not (a replayed `Prefill`).
            with nullcontext() if installed(model) else self.press(model):
                kept = self.press.after_prompt(Context(self), model) or {}
            for i, (scores, budgets) in kept.items():
                self.layers[i].keep(scores, budgets)
            self.timed("compress", start)
        if prompt_in and model is not None and reads_lanes(model):
            pack_layers(self)  # heads of different lengths: each holds its own tokens (sparsekv's attention reads)
        if self.pieces is not None and not self.forward.pieces_left:
            self.pieces = None  # the prompt is read and compressed
        if self.compiled and (self.forward.first or self.forward.q_len > 1) and not self.forward.pieces_left:
            self.ready_for_steps()
        self.forward = None

    def ready_for_steps(self) -> None:
        """After a forward of several tokens on a `compiled` cache (or rows joined into one), what its steps read
        is made, eagerly: the row tensors on each layer's device (`on`, `largest_budget`), the store slots the
        press chose for the first step (`choose`), and each layer's room (`KVLayer.make_step_room`): free slots
        up to the budget under a press that holds it while decoding (one eviction a step), else for
        `max_new_tokens` more tokens. A compiled step then finds them alike at every step, and every layer keeps
        its shape."""
        holds = self.press.holds_budget_while_decoding()
        if self.prompt_lengths is None or (holds and self.budgets is None):
            return
        if isinstance(self.state, RowState):  # the press's state, which its compiled steps may write in place
            for t in self.state.tensors():
                step_state(t)
        for layer in self.compressed_layers():
            for name in ("prompt_start", "budgets"):
                if getattr(self, name) is not None:  # (a press that keeps every token may set no budgets)
                    self.on(name, layer.device)
            self._gather_chosen(Context(self, layer), in_place=False)  # the first step's, which its slot joins
            for t in () if layer.lanes is None else layer.lanes.tensors():  # (read by every step, as they are)
                step_state(t)
            if holds:  # room up to the largest budget: the row's, or the layer's own head-wise one
                layer.make_step_room((layer.largest_budget or self.largest_budget) - layer.slots)
            else:
                layer.make_step_room(self.max_new_tokens - layer.free_slots())
        self.layouts = step_layouts({i: layer for i, layer in enumerate(self.layers) if isinstance(layer, KVLayer)})

    def _gather_chosen(self, ctx: Context, in_place: bool) -> None:
        """The store slots the press's `choose` says `ctx.layer` reads, gathered into its working set (`in_place`:
        into its own tensors, a compiled step's, which keep their shapes); nothing when it says None."""
        chosen = self.press.choose(ctx) if self.press.selects_before_attention else None
        if chosen is None:
            return
        if in_place:
            ctx.layer.gather_in_place(*chosen[:2])
        else:
            ctx.layer.gather(*chosen)

    def _open_forward(self, layer_idx: int) -> Forward:
        forward = self.forward
        if forward is None:
            raise RuntimeError(
                f"sparsekv: this cache was built under {type(self.press).__name__} and is used without it (layer "
                f"{layer_idx}); continue it inside `with press(model):` on the model the press was installed on.")
        return forward

    # --- generic state operations: every press, every layer (the batch's: `sparsekv.rows`) ----------------
    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` tokens (assisted decoding's rejected draft): the press takes back
        what they added to its state (`Press.crop`), and every layer drops their KV."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop: give a negative number of tokens to remove; got {tokens_to_remove}.")
        length = self.get_seq_length() + tokens_to_remove
        self.layouts = {}  # (the next forward of several tokens finds them again, `ready_for_steps`)
        if tokens_to_remove and self.prompt_lengths is not None:
            self.press.crop(self, length)  # first: it may read the rejected tokens' KV
        for layer in self.layers:
            if isinstance(layer, KVLayer):
                layer.crop_to(length)
            else:
                layer.crop(tokens_to_remove)

    def reset(self) -> None:
        """Empty, as a new cache for the same press and model: every layer and all press state start anew."""
        self.__init__(self.press, self.config, self.compiled, self.max_new_tokens)

    def stats(self) -> CacheStats:
        """What the cache holds now (see `CacheStats`)."""
        return cache_stats(self)

    def prompt_kept(self) -> dict[int, torch.Tensor]:
        """Per compressed layer, `(batch, kv_heads, prompt)` booleans: the prompt tokens whose KV it reads now."""
        return prompt_kept(self)
