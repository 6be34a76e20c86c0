"""SentenceKV (Zhu et al., 2025, "SentenceKV: Efficient LLM Inference via Sentence-Level Semantic KV Caching").

The algorithm, as the paper lays it out: prefill (sec. 4.1) in `compress`, decoding (sec. 4.2, Algorithm 1) in
`on_queries`, `similarity` and `chosen`. Its state: `sentence_state`; its executor (loading chosen tokens, and
`rank_at="step"`): `sentence_step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..attention import rotate
from ..buffers import host_reads_free
from ..cache import SparseCache
from ..context import Context
from ..options import check_number
from ..store import StoreLayer
from .sentence_segment import closing_table, sentence_ids
from .sentence_state import SentenceState, as_rows, end_sentence
from .sentence_step import load, loading_room, rank_step
from .snapkv import SnapKVPress


@dataclass(kw_only=True)
class SentencePress(SnapKVPress):
    """Keep the prompt as sentences in an offload store; at every decoding step, attend to the sentences whose
    keys best match the mean query of the sentence being generated.

    Prefill (sec. 4.1): the prompt is split into sentences (`sentence_segment`: Punkt, blank lines, sentences over
    mean + 2 std tokens cut, A.7). SnapKV's window scores, summed over the heads, keep the best `keep_factor *
    budget` prompt tokens (A.7's global prefilter) besides the attention sinks and the recent window, which stay on
    the device; the kept tokens' KV goes to the store, and each sentence's vector per KV head stays on the device.
    Decoding (sec. 4.2, Algorithm 1): the queries of the sentence being generated are summed (eq. 2, reset after a
    token that ends a sentence), the query heads of each GQA group together; per KV head the sentences are ranked
    by their score against that query, and the tokens of the best ones are loaded until tau (the last sentence
    taken cut at its first tokens). Only tokens entering the selection are copied, found on the host before the
    step (a compiled step on a GPU, where a host read waits for the device, writes its whole loaded region
    instead: `loads_in_graph`). Attention reads the sinks, the loaded tokens, the recent window and the generated
    tokens.

    Where sparsekv departs from the paper, each one option away (`max_sentence_tokens=128,
    sentence_vector="mean", rank_at="layer"` is the paper's eq. 1 and Algorithm 1; their measured effect:
    docs/results.md): sentences cut at 32 tokens, a sentence scored by the most any of its keys can score, keys
    taken relative to the prompt's mean key, the generated sentence begun in the prompt, every layer ranked when a
    step begins. The sinks and the window (32 + 32, the authors' code; the paper names neither) come on top of tau.

    Args:
        tokenizer: the model's tokenizer (required: sentences are found in the decoded prompt).
        budget: tau, stored prompt tokens loaded and attended at each decoding step (Algorithm 1 line 17); the
            sinks and the recent window are attended besides (the authors' code loads tau - 64 instead).
        ratio: tau as a fraction of each prompt, instead of `budget`. A prompt no longer than tau plus the sinks
            and the window is kept whole (every token attended, nothing offloaded).
        keep_factor: r, prompt tokens kept in the store per token of tau (default 2, sec. 4.1 "r = 2 or 3").
        n_sinks: first prompt tokens always attended (default 32, the authors' code).
        window_size: SnapKV's observation window, also the recent window always attended, in tokens (default 32).
        kernel_size: SnapKV's pooling kernel, in tokens (default 15, as `SnapKVPress`; the authors' code uses 7).
        pooling: SnapKV's pooling, "max" or "avg" (default "max").
        offload_device: where the store lives (default "cpu", pinned when the model is on CUDA; checked at
            construction).
        max_sentence_tokens: longest sentence, in tokens; longer ones are cut into equal pieces (default 32,
            sparsekv's: about the paper's median sentence, A.4; A.7's cut alone leaves prose sentences of 50-100).
        prompt_sentence: when the prompt ends inside a sentence (an answer prefix), the sentence being generated
            began in the prompt, and its prompt tokens' queries start the sum (default True, sparsekv's; False:
            the paper's empty sentence cache at the first step).
        centre: sentence vectors from each kept key minus the prompt's mean key (taken before RoPE, rotated back to
            the key's position), so that the component every key shares, which RoPE turns with position, does not
            rank sentences by distance (default True, sparsekv's; False: eq. 1 on the cached keys).
        sentence_vector: what stands for a sentence. "bounds" (default, sparsekv's, Quest's page bound applied to
            sentences): each channel's min and max over its kept keys, scored `sum_i max(q_i min_i, q_i max_i)`,
            the most any of its keys can score (twice the device memory of a mean). "mean": eq. 1's mean key,
            scored `q . k_s`.
        rank_at: when a decoding step ranks and loads the sentences. "step" (default, sparsekv's): every layer's
            at once when the step begins, from the queries before the step's (`sentence_step`); "layer"
            (Algorithm 1's order): each layer once it has the step's query.
    """

    tokenizer: Any = field(default=None, repr=False, compare=False, kw_only=False)
    keep_factor: float = 2.0
    n_sinks: int = 32
    offload_device: str = "cpu"
    max_sentence_tokens: int = 32
    prompt_sentence: bool = True
    centre: bool = True
    sentence_vector: str = "bounds"
    rank_at: str = "step"
    reads_input_ids: ClassVar[bool] = True
    compiled_decoding: ClassVar[bool] = True  # loads on the host, or fixed-width in the graph (`loads_in_graph`)
    joins_rows: ClassVar[bool] = True  # stores and sentences padded per row (`StoreLayer.joined`, the state's)
    paper_name: ClassVar[str] = "SentenceKV"

    def __post_init__(self):
        if self.tokenizer is None:
            raise ValueError("SentencePress: tokenizer is required (the model's tokenizer, to find the prompt's "
                             "sentences): SentencePress(tokenizer, budget=1024).")
        self.keep_factor = check_number("SentencePress", "keep_factor", self.keep_factor, low=1,
                                        unit="r, stored tokens per token of tau")
        self.n_sinks = check_number("SentencePress", "n_sinks", self.n_sinks, integer=True, low=0, unit="tokens")
        self.max_sentence_tokens = check_number("SentencePress", "max_sentence_tokens", self.max_sentence_tokens,
                                                integer=True, low=1, unit="tokens")
        for name in ("prompt_sentence", "centre"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SentencePress: {name} must be True or False; got {getattr(self, name)!r}.")
        if self.rank_at not in ("layer", "step"):
            raise ValueError(f"SentencePress: rank_at must be 'layer' (each layer at its query, the paper's) or "
                             f"'step' (every layer when a step begins); got {self.rank_at!r}.")
        if self.sentence_vector not in ("mean", "bounds"):
            raise ValueError(f"SentencePress: sentence_vector must be 'mean' (eq. 1) or 'bounds'; got "
                             f"{self.sentence_vector!r}.")
        try:
            torch.device(self.offload_device)
        except (RuntimeError, TypeError):
            raise ValueError(f"SentencePress: offload_device must be a torch device such as 'cpu'; got "
                             f"{self.offload_device!r}.") from None
        try:  # a device this machine has (a CUDA one on a CPU-only torch fails at generate otherwise)
            torch.empty(0, device=self.offload_device)
        except (RuntimeError, AssertionError) as err:
            raise ValueError(f"SentencePress: offload_device={self.offload_device!r} is not available here ({err}); "
                             "use 'cpu' (the default).") from None
        super().__post_init__()

    def min_kept(self) -> tuple[int, str]:
        return 1, "1 loaded token"

    def attended_beside(self) -> int:
        return self.n_sinks + self.window_size  # attended at every step besides tau

    def prompt_tail(self) -> int | None:
        # The window's queries and those of the prompt's last sentence (`prompt_sentence`), never longer than
        # `max_sentence_tokens`; its sentences come from the pieces' tokens, its mean key from the cache.
        return max(self.window_size, self.max_sentence_tokens)

    def new_layer(self, layer_idx: int) -> StoreLayer:
        return StoreLayer(self.offload_device)

    def new_state(self, cache: SparseCache) -> SentenceState:
        return SentenceState()

    def begin_forward(self, ctx: Context) -> None:
        state, forward = ctx.state, ctx.forward
        if state.sentences is None:  # the prompt, or a piece of it: segmented at `compress`, once all is read
            ids = forward.input_ids
            state.prompt_ids = ids if state.prompt_ids is None else torch.cat([state.prompt_ids, ids], 1)
            if state.closes is None:  # every token id's sentence end, looked up on the device at each step
                state.closes = closing_table(self.tokenizer).to(ids.device)
        state.step_ids = forward.input_ids
        for stack in state.stacks:  # this forward's queries, kept for `crop`
            stack.step_queries = [None] * len(stack.ranks)
        if self.rank_at == "step":  # the stacks whose loads the host finds (`loads_in_graph`; none at the prompt)
            rank_step(self, ctx.cache, [stack for stack in state.stacks if stack.device_slot is not None])

    def loads_in_graph(self, cache: SparseCache, device: torch.device) -> bool:
        """Whether a step finds the tokens entering a layer's selection in its graph, by writing the whole loaded
        region (`sentence_step.load_region`): a compiled cache's where a host read waits for the device (a GPU),
        or ranking at each layer. Else the loads are found on the host (`sentence_step.load_all`), which copies only
        the tokens entering; with `rank_at="step"`, before the step (`begin_forward`, on a compiled cache too)."""
        return cache.compiled and (self.rank_at == "layer" or not host_reads_free(device))

    # --- prefill ---------------------------------------------------------------------------------------------
    def compress(self, ctx: Context) -> None:
        state, layer = ctx.state, ctx.layer
        if state.sentences is None:  # the first compressed layer: the prompt's sentences (sec. 4.1)
            real = ctx.valid[:, 0]  # the prompt's tokens (every head alike)
            state.sentences = sentence_ids(self.tokenizer, state.prompt_ids, real, self.max_sentence_tokens)
            state.prompt_ids = None
        taus = self.row_budgets(ctx)
        if taus is None:  # every prompt token would be attended anyway
            return
        b, h, n, _ = ctx.keys.shape
        device = ctx.keys.device
        start = ctx.prompt_start[:, None]
        valid = ctx.valid[:, 0]  # the prompt's (every head alike)
        # Attended at every step: each row's first n_sinks tokens and the last window_size. A row too short for both
        # (kept whole beside longer ones) has them overlap, or reach into its padding: those slots are fillers.
        sinks = start + torch.arange(self.n_sinks, device=device)
        recent = (n - self.window_size + torch.arange(self.window_size, device=device)).expand(b, -1)
        keep = torch.cat([sinks, recent], dim=1)  # (b, fixed), by position
        real_slot = torch.cat([sinks < n - self.window_size, recent >= start], dim=1)
        resident = torch.zeros(b, n + 1, dtype=torch.bool, device=device).scatter_(1, keep.where(real_slot, n), True)
        resident, keep = resident[:, :n], keep.clamp(max=n - 1)
        # Global prefilter (A.7): the best r * tau prompt tokens, summed over the heads; sinks and window apart.
        scores = self.window_scores(ctx).sum(dim=1).masked_fill(resident | ~valid, float("-inf"))
        kept = (taus.double() * self.keep_factor).round().long().to(device)
        store = scores.sort(dim=-1, descending=True, stable=True).indices[:, : int(kept.max())]
        in_store = (torch.arange(store.shape[1], device=device) < kept[:, None]) & scores.gather(1, store).isfinite()
        store = torch.where(in_store, store, n).sort(dim=-1).values  # by position; n: an empty slot, last
        in_store = store < n
        store = store.clamp(max=n - 1)
        shared = self._shared_keys(ctx, valid, store) if self.centre else 0.0
        # Device slots: the loaded region (filled below, then at each step), then sinks + window. Rows with fewer
        # stored tokens than slots: the same count of real slots on every head, fillers last and never attended.
        loaded = int(taus.max())
        fill = torch.minimum(taus.to(device), in_store.sum(-1))[:, None, None]  # (b, 1, 1) real loaded slots
        real = torch.arange(loaded, device=device) < fill[:, 0]  # (b, loaded)
        sentence_keys, sizes, slot_sentence = self._fill_store(layer, store, in_store, state.sentences.to(device),
                                                               shared, self.sentence_vector, real)
        slots = torch.cat([keep.new_zeros(b, loaded), keep], dim=1)[:, None].expand(b, h, -1)
        layer.select(slots, torch.cat([real, real_slot & valid.gather(1, keep)], dim=1))
        query_sum = torch.zeros(b, h, 1, ctx.keys.shape[-1], device=device, dtype=torch.float32)
        if self.prompt_sentence:
            query_sum += self._seed_queries(ctx, query_sum.device)
        r = store.shape[1]
        stack, rank = state.add_layer(
            ctx.layer_idx, query_sum=query_sum, sentence_keys=sentence_keys, sentence_sizes=sizes,
            slot_sentence=slot_sentence, slot_room=loading_room(slot_sentence[:, :1], sizes, fill),
            resident=torch.zeros(b, h, r, dtype=torch.uint8, device=device),
            device_slot=None if self.loads_in_graph(ctx.cache, device) else torch.zeros(b, h, r, dtype=torch.long,
                                                                                      device=device))
        # A complete cache from the start: the sentences best for the prompt's unfinished one (or the first ones).
        load(layer, stack, rank, self.chosen(stack.at(rank)), first=True)

    @staticmethod
    def _shared_keys(ctx, valid, store):
        """The prompt's mean key, taken before RoPE, rotated to each stored token's position `(b, h, R, d)`.

        Under RoPE the component every key shares turns with position, so `q . k` carries a term that depends
        on distance alone, large enough to rank sentences by position (the recent ones first). Subtracting this
        leaves `q . k` minus `q . mean`, which for keys without RoPE is eq. 1's ranking exactly.
        """
        weight = valid[:, None, :, None].float()
        rope = ctx.call.position_embeddings
        plain = rotate(ctx.keys.float(), rope, inverse=True)
        mean = (plain * weight).sum(2, keepdim=True) / weight.sum(2, keepdim=True).clamp(min=1)
        b, r = store.shape
        if rope is None:  # a layer without RoPE: the mean key is every token's
            return mean
        at = [t.expand(b, -1, -1).gather(1, store[..., None].expand(-1, -1, t.shape[-1])) for t in rope]
        return rotate(mean.expand(-1, -1, r, -1), at)

    @staticmethod
    def _fill_store(layer, store, in_store, sentences, shared, vector, region):
        """The prefiltered tokens' KV to the offload store (the working set's loaded region, `region` `(b, n)`,
        loads from it); returns per sentence the mean of their keys minus `shared` `(b, h, S, d)`
        (`vector="bounds"`: each channel's max, then its min, concatenated: `(b, h, S, 2 d)`), the stored tokens of
        each sentence `(b, 1, S)`, and each store slot's sentence `(b, h, R)`.

        Only sentences that kept a token are ranked, renumbered in order: the others could take no budget, and
        on long prompts they are most of them (4 in 5 at 8k tokens, r = 2), so each step's sort and similarity
        shrink as much. Empty store slots go to one more, empty, sentence (mean key 0, no tokens), as do the
        ids a row with fewer kept sentences does not use.
        """
        b, h, _, d = layer.keys.shape
        keys, values = (t.gather(2, store[:, None, :, None].expand(b, h, -1, t.shape[-1]))
                        for t in (layer.keys, layer.values))  # (values may be wider than keys)
        bucket = sentences.gather(1, store)
        prompt_sentences = int(sentences.max()) + 1
        present = torch.zeros(b, prompt_sentences + 1, dtype=torch.bool, device=store.device)
        present = present.scatter_(1, bucket.where(in_store, prompt_sentences), True)[:, :prompt_sentences]
        n_sentences = int(present.sum(1).max()) + 1  # the kept ones, and the empty one
        bucket = (present.cumsum(1) - 1).gather(1, bucket).masked_fill(~in_store, n_sentences - 1)
        slot = bucket[:, None, :, None].expand(b, h, -1, d)
        weight = in_store.float()[:, None, :, None]
        centred = keys.float() - shared
        counts = weight.new_zeros(b, n_sentences).scatter_add_(1, bucket, in_store.float())
        if vector == "bounds":  # empty slots are all in the empty sentence, which is never loaded
            high = weight.new_zeros(b, h, n_sentences, d).scatter_reduce_(2, slot, centred, "amax", include_self=False)
            low = weight.new_zeros(b, h, n_sentences, d).scatter_reduce_(2, slot, centred, "amin", include_self=False)
            sentence_keys = torch.cat([high, low], dim=-1)
        else:
            sums = weight.new_zeros(b, h, n_sentences, d).scatter_add_(2, slot, centred * weight)
            sentence_keys = sums / counts.clamp(min=1)[:, None, :, None]
        layer.fill_store(keys, values, store, region)
        return sentence_keys, counts.long()[:, None], bucket[:, None].expand(b, h, -1)

    @staticmethod
    def _seed_queries(ctx, device):
        """The start of each row's sentence query sum (eq. 2) `(b, h, 1, d)`: the queries of its prompt's last
        sentence when the prompt ends inside that sentence (the sentence being generated began in the prompt)."""
        sentences = ctx.state.sentences.to(device)
        last = sentences == sentences[:, -1:]  # left padding: the last column is every row's last real token
        last &= ~ends_sentence(ctx).to(last.device)[:, None]
        if not bool(last.any()):
            return 0.0
        start = int(last.long().argmax(dim=1).where(last.any(dim=1), last.shape[1]).min())
        queries = ctx.queries(start, grouped=True).float() * last[:, None, start:, None]
        return queries.sum(dim=2, keepdim=True)

    # --- decoding --------------------------------------------------------------------------------------------
    def choose(self, ctx: Context) -> None:
        """`rank_at="step"` where a step finds its loads in its graph (`loads_in_graph`): at a forward's first
        compressed layer, before its mask, every layer's sentences ranked and loaded with the queries before this
        forward (`rank_step`); elsewhere that was done before the forward (`begin_forward`). Each layer then reads
        its working set as it holds it (None). (Not when the core plans a compiled cache's steps,
        `SparseCache.ready_for_steps`, which runs no layer: `ctx.call` None.)"""
        state = ctx.state
        if self.rank_at == "step" and ctx.call is not None and state.stacks and \
                next(iter(state.stacks[0].ranks)) == ctx.layer_idx:
            rank_step(self, ctx.cache, [stack for stack in state.stacks if stack.device_slot is None])
        return None

    def on_queries(self, ctx: Context) -> None:
        found = ctx.state.find(ctx.layer_idx)
        if found is None:  # not compressed: every prompt token attended
            return
        stack, rank = found
        queries = ctx.queries(grouped=True).float()  # (b, kv_heads, q, d), the step's own projection
        valid = ctx.forward.input_valid
        if valid is not None:  # padding tokens add nothing
            queries = queries * valid.to(queries.device)[:, None, :, None]
        added = queries if queries.shape[2] == 1 else queries.sum(dim=2, keepdim=True)
        stack.query_sum.select(1, rank).add_(added)  # eq. 2 (two ops; `[:, rank] +=` takes four)
        stack.step_queries[rank], stack.before_reset = queries, None  # kept for `crop`, no copy
        if self.rank_at == "step":  # ranked and loaded when the step began, with the queries before it
            return
        load(ctx.layer, stack, rank, self.chosen(stack.at(rank)))  # Algorithm 1

    @staticmethod
    def similarity(state) -> torch.Tensor:
        """`q . k_s` `(b, h, S)` of each KV head's mean query with each sentence vector (bounds: the bound), from a
        layer's ranking state (`LayerStack.at`), or `(b, layers, h, S)` from a whole `LayerStack`."""
        # The mean query (eq. 2), its GQA group averaged: a sum ranks the sentences alike (a positive scale).
        query, keys = state.query_sum, state.sentence_keys
        if keys.shape[-1] != query.shape[-1]:  # bounds [max | min]: q_i max_i where q_i > 0, q_i min_i elsewhere
            query = torch.cat([query.clamp(min=0), query.clamp(max=0)], dim=-1)
        # One batched product, never the elementwise product and a sum: that writes and reads a temporary the size
        # of every sentence vector (all layers' with `rank_at="step"`), 2.5x the time of the product.
        return torch.matmul(keys, query.transpose(-1, -2)).squeeze(-1)

    @classmethod
    def chosen(cls, state) -> torch.Tensor:
        """The store slots `(b, h, R)` of the best sentences for the current mean query, `fill` per head, from a
        layer's ranking state (`LayerStack.at`), or `(b, layers, h, R)` from a whole `LayerStack`."""
        similarity = cls.similarity(state)
        # Best sentences first, each taking its kept tokens until the budget (the last one cut): a sort over the
        # sentences, then a per-slot test against a bound fixed at prefill, never a sort over stored tokens.
        ranked = similarity.argsort(dim=-1, descending=True, stable=True)
        through = state.sentence_sizes.expand_as(ranked).gather(-1, ranked).cumsum(-1)
        through = torch.empty_like(through).scatter_(-1, ranked, through)  # back in sentence order
        return through.gather(-1, state.slot_sentence) < state.slot_room

    def after_step(self, ctx: Context) -> None:
        found = ctx.state.find(ctx.layer_idx)
        if found is not None and ctx.layer_idx == found[0].last:  # every layer's at once, after the last
            end_sentence(found[0], ends_sentence(ctx))

    def crop(self, cache: SparseCache, length: int) -> None:
        """A rejected draft: its queries leave the mean query, and so does a sentence end it caused; the last kept
        token decides whether a sentence ends instead."""
        ids = cache.state.step_ids  # the last forward's tokens
        for stack in cache.state.stacks:  # the layers' sums are one tensor, cropped at once
            if stack.step_queries[0] is None:
                continue
            queries = torch.stack(stack.step_queries, dim=1)  # (b, layers, h, q, d)
            q, removed = queries.shape[-2], cache.layers[stack.last].logical_len - length
            if removed > q:
                raise ValueError(f"SentencePress: can only crop the last forward's {q} tokens; asked for {removed}.")
            total = stack.query_sum if stack.before_reset is None else stack.before_reset
            stack.query_sum = total - queries[..., q - removed:, :].sum(dim=-2, keepdim=True)
            if removed < q:  # the forward's last kept token may end a sentence
                ends = cache.state.closing(ids[:, q - removed - 1])
                stack.query_sum.masked_fill_(as_rows(ends, stack.query_sum), 0.0)
            stack.before_reset = None
            stack.step_queries = [None] * len(stack.ranks)


def ends_sentence(ctx: Context) -> torch.Tensor:
    """`(batch,)` whether each row's last token of the forward ends a sentence (left padding: every row's last
    column), looked up on the device (`SentenceState.closing`)."""
    return ctx.state.closing(ctx.forward.input_ids[:, -1])
