"""CHESS (2026, "CHESS: Context-aware Hierarchical Efficient Semantic Selection for Long-Context LLM Inference")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm

from ..buffers import host_reads_free
from ..cache import SparseCache
from ..context import Context
from ..press import Press
from ..store import StoreLayer
from .chess_levels import best, masked_mean, top_covering, top_fraction
from .chess_options import PRESETS, settle_options
from .chess_pages import (
    CHESSState, accumulate, add_forward_keys, budget_retention, pad_columns, plan_context, plan_steps, read_stores,
    take_back, working_context,
)


def uncertainty(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy and varentropy (nats, nats^2) of the next-token distributions `logits` `(..., vocab)`."""
    logp = logits.float().log_softmax(dim=-1)
    p = logp.exp()
    logp = torch.where(p > 0, logp, 0.0)  # 0 * log 0 = 0
    entropy = -(p * logp).sum(-1)
    varentropy = (p * logp.square()).sum(-1) - entropy.square()
    return entropy, varentropy.clamp(min=0.0)


@dataclass(kw_only=True)
class CHESSPress(Press):
    """Select, at each decoding step, the pages of the context attention reads; keep every page.

    Nothing is evicted: every token's KV stays in a store, and what changes is the working context attention reads
    (sec. 3): whole pages of `page_size` tokens. Each page has a vector, the mean of its keys over every compressed
    layer and KV head (eq. 1); chunks of `chunk_pages` pages and grids of `grid_chunks` chunks pool their children
    (eq. 2); the anchor is the mean vector of the recent window's pages (eq. 3); every page, chunk and grid is scored
    by its dot product with the anchor (eq. 4), and Algorithm 1 keeps, top-down, the grids above the `1 - rho_g`
    quantile, the chunks of kept grids above the `1 - rho_c` quantile, then the pages of kept chunks above the
    `1 - rho_p` quantile. One selection serves every layer of a row. Attention reads the sink pages, the selected
    pages, the window pages and the current partial page. The selection is made after a prompt, then again after a
    step whose next-token distribution is uncertain (sec. 3.3: entropy and varentropy over their thresholds); in
    between, new tokens join the working context, which is gathered again when the window slides. A prompt
    continued after the first (a question asked of a context compressed before it) is read as the first: it
    attends every token, then selects for it.

    Where sparsekv departs from the paper, each one option away (`paper=True` sets the paper's letter; measured
    effects: docs/results.md): 16-token pages overlapping by half, chunks and grids scored by their best page, page
    vectors from keys before RoPE, centred before eq. 4. Where the paper is silent: sink and window pages are
    attended always and are not candidates; the hierarchy starts at each row's first token; the default thresholds
    are the 99th percentiles `calibrate` gives on SmolLM2-135M-Instruct over the papers' text.

    Give one of `preset`, `ratios`, `ratio` or `read_budget`. CHESS keeps every token, so it takes no `budget`
    (tokens kept, the other presses' option): `read_budget` is what a step reads.

    Args:
        preset: "conservative" (0.9, 0.9, 0.9), "moderate" (0.8, 0.7, 0.7) or "aggressive" (0.5, 0.2, 0.1),
            Table 1.
        ratios: (rho_g, rho_c, rho_p), fractions of grids, of chunks of kept grids and of pages of kept chunks
            selected, each in (0, 1].
        ratio: the fraction of candidate pages selected, split evenly over the levels (rho = ratio ** (1 / 3);
            sparsekv's, to sweep CHESS on the axis of the other presses).
        read_budget: tokens a step attends after a selection, sink, window and partial pages included (sparsekv's):
            per row, the fraction of its pages that fills it; at least (sink_pages + window_pages + 1) * page_size.
        page_size: tokens per page (default 16, sparsekv's; 32 with `paper`, sec. 5.1).
        page_stride: tokens from a page's start to the next's, dividing `page_size` (default `page_size / 2`,
            sparsekv's: a span a page boundary would cut lies whole in some page; `page_size` with `paper`). The
            last level of Algorithm 1 counts blocks of `page_stride` tokens, so a ratio reads as many tokens.
        chunk_pages: pages per chunk (default 4; the paper gives no value).
        grid_chunks: chunks per grid (default 4; the paper gives no value).
        sink_pages: first pages always attended (default 1).
        window_pages: most recent complete pages always attended, and the anchor (default 2).
        reselect: "uncertainty" (sec. 3.3, default), "always" (every step), or "never" (after prompts only).
        reselect_every: select again every N decoding steps instead (Appendix C's fixed schedule).
        entropy_threshold: the uncertainty trigger, in nats (default 6.7; `calibrate` sets both thresholds).
        varentropy_threshold: the uncertainty trigger, in nats^2 (default 12.4).
        pre_rope: page vectors from the keys before RoPE (default True; the paper says "key states"): after RoPE a
            page's mean key carries its position, and eq. 4 then ranks pages by distance more than content.
        centre: subtract the mean candidate page vector from every page vector and the anchor before eq. 4
            (default True, sparsekv's; False with `paper`): the keys of real models share a common component that
            eq. 4 would otherwise rank pages by.
        pooling: how a chunk or grid is scored from its children: "max" (default, sparsekv's: its best child) or
            "mean" (eq. 2's mean vector; with `paper`).
        paper: the paper's letter where sparsekv departs from it, unless given: 32-token pages one after the
            other, eq. 2's mean, eq. 4 uncentred (default False).
    """

    preset: str | None = None
    ratios: tuple[float, float, float] | None = None
    read_budget: int | None = None
    # Tokens kept: CHESS keeps every token (`read_budget` is what a step reads; `budget=` is refused naming it).
    budget: None = field(default=None, init=False, repr=False)
    budget_options: ClassVar[tuple[str, ...]] = ("preset", "ratios", "read_budget")
    page_size: int | None = None  # 16, or 32 with `paper`
    page_stride: int | None = None  # page_size / 2, or page_size with `paper`
    chunk_pages: int = 4
    grid_chunks: int = 4
    sink_pages: int = 1
    window_pages: int = 2
    reselect: str = "uncertainty"
    reselect_every: int | None = None
    entropy_threshold: float = 6.7
    varentropy_threshold: float = 12.4
    pre_rope: bool = True
    centre: bool | None = None  # True, or False with `paper`
    pooling: str | None = None  # "max", or "mean" with `paper`
    paper: bool = False
    reads_prompt_in_pieces: ClassVar[bool] = True  # it keeps every token and selects again after a continued prompt
    compiled_decoding: ClassVar[bool] = True  # over fixed shapes (`chess_pages.plan_steps`)

    def __post_init__(self):
        settle_options(self)

    @property
    def retention(self) -> tuple[float, float, float]:
        """(rho_g, rho_c, rho_p): from `preset` (Table 1), `ratios`, or `ratio` split evenly over the levels."""
        if self.preset is not None:
            return PRESETS[self.preset]
        if self.ratios is not None:
            return self.ratios
        return (self.ratio ** (1 / 3),) * 3

    def retention_for(self, lengths: torch.Tensor, n_blocks: int) -> tuple:
        """`retention`, or with `read_budget` per row `(batch,)`, the fractions that fill it (`budget_retention`), for
        rows of `lengths` tokens on a grid of `n_blocks` blocks."""
        return self.retention if self.read_budget is None else budget_retention(self, lengths, n_blocks)

    def new_layer(self, layer_idx: int) -> StoreLayer:
        return StoreLayer(records_tokens=True)  # every token stays in the store; attention reads a working set

    def new_state(self, cache: SparseCache) -> CHESSState:
        ranks = [i for i, layer in enumerate(cache.layers) if isinstance(layer, StoreLayer)]
        return CHESSState(columns={i: r for r, i in enumerate(ranks)})

    def compress(self, ctx: Context) -> None:
        state, i, rope = ctx.state, ctx.layer_idx, ctx.call.position_embeddings
        accumulate(self, ctx.cache, ctx.layer, i, 0, rope)
        if rope is None:
            state.unrotated.add(i)
        elif state.rope_layer in (None, i):
            state.rope_layer, state.last_rope = i, rope

    def after_step(self, ctx: Context) -> None:
        if self.pre_rope and ctx.layer_idx == ctx.state.rope_layer:  # the rotary layers share the table
            ctx.plan = ctx.call.position_embeddings  # the forward's (cos, sin): its keys join the sums at its end

    def crop(self, cache: SparseCache, length: int) -> None:
        """A rejected draft: its keys leave the page sums (`take_back`), and a working context planned with them
        is planned again."""
        state = cache.state
        if state.page_sums is None:
            return
        if cache.compiled:
            raise ValueError("CHESSPress: a compiled cache cannot be cropped (its steps keep the page sums "
                             "current in place); make the cache without compiled=True.")
        take_back(self, cache, length)
        if state.fresh:
            start = cache.on("prompt_start", state.context[0].device)
            state.context = working_context(self, state.selected, length - start, start)

    def end_forward(self, ctx: Context) -> None:
        """After every forward, eager or compiled, one path: the forward's keys join the page sums; after a
        prompt, or a step whose trigger fires, Algorithm 1 selects; the working context of the next forward."""
        state, cache, forward = ctx.state, ctx.cache, ctx.forward
        first = state.selected is None
        prompt = first or forward.continues_prompt  # the first prompt or a continued one: read whole, selected for
        # A compiled cache's step keeps its shapes and the addresses its graph holds: its state is written in place.
        in_place = cache.compiled and not prompt and state.page_sums is not None
        if state.page_sums is None:
            state.fresh = False
            return
        start = cache.on("prompt_start", state.page_sums.device)
        layer = cache.layers[next(iter(state.columns))]  # (every compressed layer holds the same tokens)
        if first:  # its keys were summed as it was compressed (`compress`)
            lengths = layer.logical_len - start
        else:
            lengths = add_forward_keys(self, cache, forward.q_len, ctx.plan)[:, -1] + 1 - start
        if prompt:
            trigger = torch.ones_like(lengths, dtype=torch.bool)
            if state.steps is None:
                state.steps = torch.zeros_like(lengths)
        else:
            state.steps += 1
            trigger = self.triggers(ctx.logits[:, -1], state.steps)
        if in_place:
            if self.reselects:  # (counted here: the selection a trigger asks for is made before the next step)
                state.selections.add_(trigger)
            if host_reads_free(trigger.device):  # read before the next step, as an eager step's end reads it
                state.triggered.copy_(trigger)  # (`begin_forward`)
                return
            # Where a host read waits for the device: Algorithm 1 at every step, taken where the trigger fires, and
            # the working context rewritten, in the step's graph (no branch: inductor reads a branch's condition
            # with a wait for the device and records no CUDA graph of a step that holds one, torch 2.13).
            if self.reselects:
                state.selected.copy_(self.reselected(state.page_sums, lengths, state.most, trigger, state.selected))
            width = state.context[0].shape[1] // self.page_stride  # (a size: a constant of the graph)
            for old, new in zip(state.context[:2], working_context(self, state.selected, lengths, start, width)):
                old.copy_(new)
            return
        # Eagerly, Algorithm 1 when a row's trigger fires, taken in those rows (the step's one read on the host).
        reselect = prompt or self.reselects and bool(trigger.any())
        if reselect:
            if first:
                state.selected = self.blocks_of(self.select(state.page_sums, lengths)[-1])
            else:
                state.selected = self.reselected(state.page_sums, lengths, None if prompt else state.most, trigger,
                                                 state.selected)
            state.selections = trigger.long() if first else state.selections + trigger
        width = plan_steps(self, cache, lengths) if cache.compiled and prompt else None  # a compiled cache's
        if not first:
            state.last_rope = ctx.plan
        state.fresh = plan_context(self, cache, lengths, start, reselect, width)

    def select_between_steps(self, cache: SparseCache) -> None:
        """Before a compiled cache's step where the host reads the device without a wait (a CPU): what an eager
        step's end does with the last step's trigger (`end_forward`), its rows' Algorithm 1 and the working
        context, made on the host and gathered into the layers only when a selection or the window changes it,
        instead of in every step's graph (whose layers then keep their working sets: `fresh` False)."""
        state = cache.state
        start = cache.on("prompt_start", state.page_sums.device)
        lengths = cache.layers[next(iter(state.columns))].logical_len - start
        reselect = self.reselects and bool(state.triggered.any())
        if reselect:
            state.selected.copy_(self.reselected(state.page_sums, lengths, state.most, state.triggered,
                                                 state.selected))
        if plan_context(self, cache, lengths, start, reselect, state.context[0].shape[1] // self.page_stride):
            for i in state.columns:
                cache.layers[i].gather_in_place(*state.context[:2])
        state.fresh = False

    def reselected(self, page_sums: torch.Tensor, lengths: torch.Tensor, most: torch.Tensor | None,
                   trigger: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """The blocks `(batch, blocks)` selected after this forward: Algorithm 1's in the rows whose `trigger`
        `(batch,)` fires, `selected` (the last selection, padded to the blocks there are now) in the others."""
        fresh = self.blocks_of(self.select(page_sums, lengths, most)[-1])
        return torch.where(trigger[:, None], fresh, pad_columns(selected, fresh.shape[1]))

    def triggers(self, logits: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """`(batch,)` which rows re-select after their decoding step `steps` `(batch,)`, from their next-token
        `logits`."""
        b = logits.shape[0]
        if self.reselect_every is not None:
            return steps % self.reselect_every == 0
        if self.reselect != "uncertainty":
            return torch.full((b,), self.reselect == "always", device=logits.device)
        entropy, varentropy = uncertainty(logits)
        return (entropy > self.entropy_threshold) & (varentropy > self.varentropy_threshold)

    @property
    def reselects(self) -> bool:
        """Whether selections follow the prompt's: on the uncertainty trigger, at every step, or on a schedule."""
        return self.reselect_every is not None or self.reselect != "never"

    @property
    def span(self) -> int:
        """Blocks (of `page_stride` tokens) per page: 1 when pages do not overlap."""
        return self.page_size // self.page_stride

    def block_roles(self, lengths: torch.Tensor, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(batch, blocks)` masks: blocks always attended and the others. Sink pages, window pages and the partial
        page are laid on the grid of non-overlapping pages from each row's first token, whatever the stride, so
        overlapping pages add candidates between the paper's pages and change nothing else."""
        block = torch.arange(n_blocks, device=lengths.device)[None, :]
        complete = lengths.div(self.page_size, rounding_mode="floor")[:, None] * self.span  # blocks of whole pages
        exists = block * self.page_stride < lengths[:, None]
        always = exists & ((block < self.sink_pages * self.span) | (block >= complete - self.window_pages * self.span))
        return always, exists & ~always

    def page_vectors(self, page_sums: torch.Tensor, lengths: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Page vectors `(batch, pages, D)` (eq. 1, centred if `centre`), the anchor `(batch, D)` (eq. 3) and
        the candidate pages `(batch, pages)`, for rows of `lengths` real tokens. Page k starts at block k (as many
        pages as blocks, `page_sums`' own: those past the row's end are no candidates); a candidate's blocks all are."""
        n_blocks = page_sums.shape[1]  # (a fixed grid: no host read, and a compiled step keeps its shapes)
        always, candidate = self.block_roles(lengths, n_blocks)
        block = torch.arange(n_blocks, device=lengths.device)
        sums = page_sums
        if self.span > 1:  # page k: blocks k ... k + span - 1
            sums = nn.functional.pad(sums, (0, 0, 0, self.span - 1)).unfold(1, self.span, 1).sum(-1)
            # Candidate blocks run from the sink's end to the window's start: a page is one when its first and
            # last blocks are. (Compared, not a padded mask pooled: inductor's CPU code for that fails to build.)
            last = block + self.span - 1
            candidate = candidate & candidate.gather(1, last.clamp(max=n_blocks - 1).expand_as(candidate)) & (
                last < n_blocks)
        counts = lengths[:, None] - block * self.page_stride
        vectors = sums / counts.clamp(1, self.page_size)[..., None]  # eq. 1: page means
        if self.centre:  # remove the component every page shares, so that eq. 4 measures what sets pages apart
            vectors = vectors - masked_mean(vectors, candidate, dim=1)[:, None]
        # Eq. 3 over the window's pages and the partial page, on the grid of non-overlapping pages.
        window = always & (block >= self.sink_pages * self.span) & (block % self.span == 0)
        return vectors, masked_mean(vectors, window, dim=1), candidate

    def blocks_of(self, pages: torch.Tensor) -> torch.Tensor:
        """`(batch, blocks)`: the blocks of `pages` `(batch, pages)`; page k covers blocks k ... k + span - 1."""
        if self.span == 1:
            return pages
        return nn.functional.pad(pages, (self.span - 1, 0)).unfold(1, self.span, 1).any(-1)

    def select(self, page_sums: torch.Tensor, lengths: torch.Tensor, most: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Algorithm 1: masks of the selected grids `(batch, grids)`, chunks `(batch, chunks)` and candidate pages
        `(batch, pages)`, for rows of `lengths` real tokens (page k starts at block k: `blocks_of` gives the blocks
        attention reads). Chunks and grids group consecutive pages. `most`: as `select_by`."""
        vectors, anchor, candidate = self.page_vectors(page_sums, lengths)
        scores = (vectors @ anchor[:, :, None])[..., 0]  # eq. 4 for every page: one GEMM
        return self.select_by(scores, candidate, self.retention_for(lengths, page_sums.shape[1]), most)

    def select_by(self, s_page: torch.Tensor, candidate: torch.Tensor, retention: tuple | None = None,
                  most: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Algorithm 1 from the pages' scores `s_page` and the candidate pages, both `(batch, pages)`: as `select`
        (`retention`: `retention_for` the rows, default `retention`). `most` `(batch,)`: keep at most this many
        pages per row, the best (a compiled step's fixed width, `chess_pages.most_selected`, which only pages tied
        at a quantile can exceed); None: every page Algorithm 1 keeps."""
        n_pages = s_page.shape[1]
        # Eq. 2 then eq. 4: a chunk's (grid's) vector is the mean of its candidate children, and the dot product is
        # linear, so its score is the mean of their scores; "max" pooling scores it by its best child instead.
        pad = -n_pages % (self.chunk_pages * self.grid_chunks)  # pages padded to whole grids
        s_chunk, chunk_in = self._pool(nn.functional.pad(s_page, (0, pad)), nn.functional.pad(candidate, (0, pad)),
                                       self.chunk_pages)
        s_grid, grid_in = self._pool(s_chunk, chunk_in, self.grid_chunks)
        rho_g, rho_c, rho_p = self.retention if retention is None else retention
        keep_grid = top_fraction(s_grid, grid_in, rho_g)
        active = keep_grid.repeat_interleave(self.grid_chunks, dim=1) & chunk_in
        keep_chunk = top_fraction(s_chunk, active, rho_c)
        active = keep_chunk.repeat_interleave(self.chunk_pages, dim=1)[:, :n_pages] & candidate
        if self.span == 1:
            return keep_grid, keep_chunk, best(s_page, top_fraction(s_page, active, rho_p), most)
        # Overlapping pages: the blocks of the best active pages, as many as the three fractions give of the
        # candidates' blocks (a page adds 1 to `span` blocks, so a fraction of the pages would not say how many).
        budget = (rho_g * rho_c * rho_p * self.blocks_of(candidate).sum(-1)).ceil().long()
        return keep_grid, keep_chunk, top_covering(s_page, active, budget, self.span)

    def _pool(self, scores: torch.Tensor, active: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores `(batch, n // size)` of groups of `size` consecutive entries, pooled over their active ones, and
        which groups have any."""
        b = scores.shape[0]
        scores, active = scores.view(b, -1, size), active.view(b, -1, size)
        if self.pooling == "max":
            pooled = scores.masked_fill(~active, float("-inf")).amax(-1)
        else:
            pooled = masked_mean(scores[..., None], active, dim=2)[..., 0]
        return pooled, active.any(-1)

    def begin_forward(self, ctx: Context) -> None:
        forward, state, cache = ctx.forward, ctx.state, ctx.cache
        if cache.compiled and state.selected is not None and forward.q_len > 1 and not forward.continues_prompt:
            raise ValueError("CHESSPress: a compiled cache decodes one token a step, and this forward verifies a "
                             "draft of several (assisted decoding, prompt lookup); make the cache without "
                             "compiled=True for them.")
        if forward.continues_prompt and state.selected is not None:  # read whole, selected for after it
            state.reach = state.most = state.triggered = None  # (a compiled cache's steps are planned again after it)
            read_stores(cache)
        elif state.triggered is not None and forward.q_len == 1 and host_reads_free(state.triggered.device):
            self.select_between_steps(cache)

    def choose(self, ctx: Context) -> tuple[torch.Tensor, torch.Tensor, bool | None] | None:
        """The working context made after the last forward when it changed (`end_forward`; a compiled cache's at
        every step), None when it did not: the layer then keeps its working set and appends the step's token."""
        state = ctx.state
        return state.context if state.fresh else None

    @torch.no_grad()
    def calibrate(self, model: torch.nn.Module, tokenizer: Any, texts: list[str], percentile: float = 99.0,
                  max_tokens: int = 1024) -> CHESSPress:
        """Set the re-selection thresholds to the `percentile` of entropy and varentropy over `texts`.

        Each text (at most `max_tokens` tokens) runs through `model` uncompressed; every position's next-token
        distribution counts. Returns the press (its two thresholds set), e.g. `CHESSPress(...).calibrate(...)`.
        """
        if not (0 < percentile < 100):
            raise ValueError(f"percentile must be in (0, 100); got {percentile!r}.")
        if isinstance(texts, str) or not len(texts):
            raise ValueError("texts: give a non-empty list of calibration texts.")
        entropies, varentropies = [], []
        for text in tqdm(texts, desc="calibrating CHESS thresholds", leave=False):
            ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens].to(model.device)
            entropy, varentropy = uncertainty(model(ids, use_cache=False).logits[0])
            entropies.append(entropy)
            varentropies.append(varentropy)
        q = percentile / 100
        self.entropy_threshold = float(torch.cat(entropies).quantile(q))
        self.varentropy_threshold = float(torch.cat(varentropies).quantile(q))
        return self
