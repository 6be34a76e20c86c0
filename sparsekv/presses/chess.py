"""CHESS (2026, "CHESS: Context-aware Hierarchical Efficient Semantic Selection for Long-Context LLM Inference")."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm

from ..attention import AttentionCall, rotate
from ..cache import Forward, KVLayer, SparseCache, StoreLayer
from ..press import Press, check_number
from ..state import RowState

# Table 1: retention ratios (rho_g, rho_c, rho_p) of grids, chunks and pages.
PRESETS = {"conservative": (0.9, 0.9, 0.9), "moderate": (0.8, 0.7, 0.7), "aggressive": (0.5, 0.2, 0.1)}
RESELECT = ("uncertainty", "always", "never")
POOLING = ("mean", "max")


def uncertainty(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy and varentropy (nats, nats^2) of the next-token distributions `logits` `(..., vocab)`."""
    logp = logits.float().log_softmax(dim=-1)
    p = logp.exp()
    logp = torch.where(p > 0, logp, 0.0)  # 0 * log 0 = 0
    entropy = -(p * logp).sum(-1)
    varentropy = (p * logp.square()).sum(-1) - entropy.square()
    return entropy, varentropy.clamp(min=0.0)


@dataclass
class CHESSState(RowState):
    """Per generation: the page vectors of every compressed layer and the current selection.

    Attributes:
        page_sums: `(batch, blocks, D)` float32, per block of `page_stride` tokens the sum of its keys; columns
            are (layer, KV head, dim) flattened (eq. 1), each layer filling its own columns. Block k of a row covers
            the tokens `start + k * page_stride ...` of that row, `start` its first real token, so padding is in
            no block; page k is blocks `k ... k + page_size / page_stride - 1` (one block when pages do not overlap).
        columns: layer index -> its rank among the compressed layers (its block of columns in `page_sums`).
        selected: `(batch, blocks)` blocks of the pages chosen by the last selection (Algorithm 1).
        plan: `(slots, valid, all_valid)`: `(batch, n)` store slots of a new working context, which of them are
            real, and whether all are; made after a forward for every layer of the next one (`Forward.plan`);
            None when the context did not change.
        built_at: `(batch,)` complete pages when the working context was last built (the window slides when
            a page completes), on the CPU.
        summed: store slots already added to `page_sums`; the decoded tokens after them are added when page
            vectors are next read (at a selection), all layers at once, instead of layer by layer at every step.
        rope: the `(cos, sin)` of each decoding step since `summed`, to undo RoPE on those keys (`pre_rope`).
        last_rope: the `(cos, sin)` of the last forward, to take a rejected draft's keys back out (`crop`).
        rope_layer: the first compressed layer whose keys carry RoPE, which records `rope` for all of them (they
            share the rotary table); None when none does. `unrotated`: the layers whose keys do not (NoPE layers).
    """

    page_sums: torch.Tensor | None = None
    columns: dict[int, int] = field(default_factory=dict)
    selected: torch.Tensor | None = None
    plan: tuple[torch.Tensor, torch.Tensor, bool] | None = None
    built_at: torch.Tensor | None = None
    steps: int = 0
    summed: int = 0
    rope: list = field(default_factory=list)
    last_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    rope_layer: int | None = None
    unrotated: set[int] = field(default_factory=set)


@dataclass(kw_only=True)
class CHESSPress(Press):
    """Select, at each decoding step, the pages of the context attention reads; keep every page.

    Nothing is evicted: the KV of every token stays in a store, and what changes is the working context attention
    reads (sec. 3), whole pages of `page_size` tokens (by default a page starts every `page_size / 2` tokens,
    sparsekv's: `page_stride` below). Each page has a vector, the mean of its keys
    flattened over all compressed layers and KV heads (eq. 1), brought up to date with the decoded keys at each
    selection; chunks (`chunk_pages` consecutive pages) and grids (`grid_chunks` consecutive chunks) average
    their children (eq. 2). The anchor is the mean vector of the recent window's pages (eq. 3); every grid, chunk
    and page is scored by its dot product with the anchor in one matrix product (eq. 4), and Algorithm 1 keeps,
    top-down, the grids above the `1 - rho_g` quantile, the chunks of kept grids above the `1 - rho_c` quantile of
    those, then the pages of kept chunks above the `1 - rho_p` quantile of those. One selection per sequence
    serves every layer. Attention reads sink pages + selected pages + window pages + the current partial page.

    The selection is made after the prompt, then again only after a step whose next-token distribution is
    uncertain (sec. 3.3): entropy above `entropy_threshold` and varentropy above `varentropy_threshold` (the
    upper-right region of Fig. 4). In between, the gathered working context is kept and each new token is
    appended to it; it is re-gathered (cost: its size, never the context's) when the window slides past a
    completed page. A prompt continued after the first forward (several new tokens that are not a draft being
    verified: a question asked of a context compressed before it was known, a second turn) is read as the first
    one was: it attends to every token (the store), then selects with its own tokens in the anchor's window.

    Choices beyond the paper (sparsekv's, each one option away: `paper=True` sets them all): 16-token pages,
    overlapping by half, and chunks and grids scored by their best page (`page_size`, `page_stride`, `pooling`).
    Choices the paper leaves open (sparsekv's): sink and window pages are attended always and are not
    candidates of the selection, so the ratios apply to the other pages; page vectors come from the keys before
    RoPE and are centred before scoring (`pre_rope`, `centre` below; without them the needle's page ranks among
    the last on the offline models, see `benchmarks/chess_affinity.py`); chunk and grid vectors average their
    candidate children only; the hierarchy is aligned to each row's first token; thresholds without
    calibration are the 99th percentiles measured with `calibrate` on the offline SmolLM2-135M-Instruct over
    the text of the three papers sparsekv implements (6.74 nats, 12.4 nats^2; Qwen2.5-0.5B-Instruct gives 6.43
    and 13.2); a re-selection requires both thresholds crossed.

    Give one of `preset`, `ratios`, `ratio` or `budget`.

    Args:
        preset: "conservative" (0.9, 0.9, 0.9), "moderate" (0.8, 0.7, 0.7) or "aggressive" (0.5, 0.2, 0.1),
            Table 1.
        ratios: (rho_g, rho_c, rho_p), fractions of grids, chunks of kept grids and pages of kept chunks
            selected, each in (0, 1].
        ratio: the fraction of candidate pages selected, split evenly over the three levels
            (rho = ratio ** (1 / 3) each; sparsekv's shorthand, to sweep CHESS on the same axis as other presses).
        budget: tokens a step attends after a selection, sink, window and partial pages included: per row, the
            `ratio` whose pages fill what the budget leaves (sparsekv's, as the other presses' `budget`); at least
            (sink_pages + window_pages + 1) * page_size. A prompt no longer than it is attended whole.
        page_size: tokens per page (default 16, sparsekv's; the paper's is 32, sec. 5.1). A page vector then
            averages half as much unrelated text around what matters, and the sink and window pages attend
            half as many tokens at the same ratio (docs/results.md, "CHESS with smaller pages").
        page_stride: tokens from one page's start to the next's (default `page_size / 2`, sparsekv's: pages
            overlap by half; `page_size` with `paper`, or when it is odd: pages one after the other, the paper's).
            Page k covers the `page_size` tokens from `k * page_stride`, so a span that a boundary of the paper's
            pages would cut (a code, a number) lies whole in some page, and the selection can start a page where the
            span starts. Attention reads the blocks (`page_stride` tokens) of the selected pages; Algorithm 1's last
            level takes pages, best first, while their blocks are at most the three fractions of the candidate
            pages' blocks, so a ratio attends as many tokens as without overlap. Sink and window pages are the
            paper's, on its grid of pages. Must divide `page_size`. The page sums are kept per block:
            `page_size / page_stride` times the memory of the paper's (with 8-token blocks, float32 sums of
            float32 keys are 1/16 of the KV's size). Measured at ratio 0.1 with the question at the end: 16-token
            pages at a stride of 8 find 100% of codes in Qwen2.5-0.5B's real prose at 4k tokens against 85% one
            after the other, 45% against 40% on SmolLM2-135M (docs/results.md, "CHESS's overlapping pages").
        chunk_pages: pages per chunk (default 4; the paper gives no value).
        grid_chunks: chunks per grid (default 4; the paper gives no value).
        sink_pages: first pages always attended (default 1).
        window_pages: most recent complete pages always attended, and the anchor (default 2).
        reselect: "uncertainty" (sec. 3.3, default), "always" (every step), or "never" (after prompts only:
            the first forward and any continued prompt).
        reselect_every: re-select every N decoding steps instead (the fixed schedule of Appendix C).
        entropy_threshold: uncertainty trigger, in nats (default 6.7: see above and `calibrate`).
        varentropy_threshold: uncertainty trigger, in nats^2 (default 12.4: see above and `calibrate`).
        pre_rope: page vectors from the keys before rotary position embedding (default True; the paper says
            "Key states" without saying which). After RoPE, a page's mean key carries its position, and the
            dot product of two pages depends on their distance more than on their content.
        centre: subtract the mean candidate page vector from every page vector and the anchor before eq. 4
            (default True, sparsekv's; False with `paper`). Appendix B's argument assumes unrelated keys are
            near-orthogonal, but the keys of real models share a large common component, and the raw dot product
            ranks pages by their projection on it; centring restores the premise. False is eq. 4 as written.
        pooling: how a chunk or grid is scored from its children: "max" (default, sparsekv's: its best child's
            score) or "mean" (eq. 2's mean vector, whose eq. 4 score is the mean of its children's scores). In
            real prose the mean of 4 or 16 pages drowns the one page that matters, and Algorithm 1's upper levels
            discard the grid or chunk of a page that ranks among the best (`benchmarks/chess_affinity.py`).
        paper: the paper's letter where sparsekv departs from it: 32-token pages one after the other, eq. 2's mean
            pooling and eq. 4 uncentred, unless given. Default False: 16-token pages overlapping by half, max
            pooling, centred. Measured at ratio 0.1 with the question at the end, sparsekv's defaults (pages one
            after the other, before they overlapped) against the paper's pages with mean pooling (centred):
            Qwen2.5-0.5B at 4k tokens finds 85% of codes in real prose against 20%, and 100% of multi-key needles
            in the filler haystack against 95%; SmolLM2-135M at 4k tokens 40% against 20% in prose, the same on
            the filler haystack (docs/results.md, "CHESS's defaults").
    """

    preset: str | None = None
    ratios: tuple[float, float, float] | None = None
    budget_options: ClassVar[tuple[str, ...]] = ("preset", "ratios")
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
    selects_before_attention: ClassVar[bool] = True
    reads_prompt_in_pieces: ClassVar[bool] = True  # it keeps every token and selects again after a continued prompt

    def __post_init__(self):
        name = type(self).__name__
        if not isinstance(self.paper, bool):
            raise ValueError(f"{name}: paper must be True or False; got {self.paper!r}.")
        for key, ours, papers in (("page_size", 16, 32), ("pooling", "max", "mean"), ("centre", True, False)):
            if getattr(self, key) is None:
                setattr(self, key, papers if self.paper else ours)
        given = [k for k in ("preset", "ratios", "ratio", "budget") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"{name}: give exactly one of preset ({', '.join(PRESETS)}), ratios=(rho_g, rho_c, "
                             f"rho_p), ratio (fraction of pages selected, 0 < ratio <= 1) or budget (tokens a step "
                             f"attends); got {' and '.join(given) if given else 'none'}.")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"{name}: preset must be one of {', '.join(PRESETS)}; got {self.preset!r}.")
        if self.ratio is not None:
            self.ratio = check_number(name, "ratio", self.ratio, low=0, high=1, low_open=True,
                                      unit="fraction of pages selected")
        if self.ratios is not None:
            if not (isinstance(self.ratios, (tuple, list)) and len(self.ratios) == 3):
                raise ValueError(f"{name}: ratios must be three fractions (rho_g, rho_c, rho_p), each in (0, 1]; "
                                 f"got {self.ratios!r}.")
            self.ratios = tuple(check_number(name, f"ratios[{i}]", r, low=0, high=1, low_open=True)
                                for i, r in enumerate(self.ratios))
        for key, low in (("page_size", 1), ("chunk_pages", 1), ("grid_chunks", 1), ("sink_pages", 0),
                         ("window_pages", 1)):
            setattr(self, key, check_number(name, key, getattr(self, key), integer=True, low=low))
        if self.budget is not None:  # at least the pages always attended: sinks, window and the partial page
            least = (self.sink_pages + self.window_pages + 1) * self.page_size
            self.budget = check_number(name, "budget", self.budget, integer=True, low=least,
                                       unit=f"tokens a step attends; (sink_pages + window_pages + 1) * page_size = "
                                            f"{least} are always attended")
        if self.page_stride is None:
            self.page_stride = self.page_size if self.paper or self.page_size % 2 else self.page_size // 2
        self.page_stride = check_number(name, "page_stride", self.page_stride, integer=True, low=1,
                                        high=self.page_size, unit="tokens")
        if self.page_size % self.page_stride:
            raise ValueError(f"{name}: page_stride must divide page_size ({self.page_size}); got "
                             f"{self.page_stride}.")
        for key in ("pre_rope", "centre"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{name}: {key} must be True or False; got {getattr(self, key)!r}.")
        if self.pooling not in POOLING:
            raise ValueError(f"{name}: pooling must be one of {', '.join(POOLING)}; got {self.pooling!r}.")
        if self.reselect not in RESELECT:
            raise ValueError(f"{name}: reselect must be one of {', '.join(RESELECT)}; got {self.reselect!r}.")
        if self.reselect_every is not None:
            self.reselect_every = check_number(name, "reselect_every", self.reselect_every, integer=True, low=1,
                                               unit="decoding steps")
        for key, unit in (("entropy_threshold", "nats"), ("varentropy_threshold", "nats^2")):
            setattr(self, key, check_number(name, key, getattr(self, key), low=0, unit=unit))

    @property
    def retention(self) -> tuple[float, float, float]:
        """(rho_g, rho_c, rho_p): from `preset` (Table 1), `ratios`, or `ratio` split evenly over the levels."""
        if self.preset is not None:
            return PRESETS[self.preset]
        if self.ratios is not None:
            return self.ratios
        return (self.ratio ** (1 / 3),) * 3

    def retention_for(self, lengths: torch.Tensor) -> tuple:
        """`retention`, or with `budget`, per row `(batch,)`: the fraction of a row's candidate tokens that fills
        the budget beside the tokens always attended (sink, window and partial pages), split evenly over the
        levels as `ratio` is; 1 when everything fits."""
        if self.budget is None:
            return self.retention
        n_blocks = int((-(-lengths // self.page_stride)).max())
        always, candidate = self.block_roles(lengths, n_blocks)
        start = torch.arange(n_blocks, device=lengths.device) * self.page_stride
        tokens = (lengths[:, None] - start).clamp(0, self.page_stride)  # (batch, blocks)
        spare = (self.budget - (tokens * always).sum(-1)).clamp(min=1)
        fraction = (spare / (tokens * candidate).sum(-1).clamp(min=1)).clamp(max=1.0).double()
        return (fraction ** (1 / 3),) * 3

    def new_layer(self, layer_idx: int) -> StoreLayer:
        return StoreLayer(records_tokens=True)  # every token stays in the store; attention reads a working set

    def new_state(self, cache: SparseCache) -> CHESSState:
        ranks = [i for i, layer in enumerate(cache.layers) if isinstance(layer, StoreLayer)]
        return CHESSState(columns={i: r for r, i in enumerate(ranks)})

    # --- page vectors (eq. 1), brought up to date ----------------------------------------------------------------
    def compress(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        state, i = cache.state, call.module.layer_idx
        self._accumulate(cache, layer, i, 0, call.position_embeddings)
        state.summed = layer.logical_len
        if call.position_embeddings is None:
            state.unrotated.add(i)
        elif state.rope_layer in (None, i):
            state.rope_layer, state.last_rope = i, call.position_embeddings

    def after_step(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        state = cache.state
        if self.pre_rope and call.module.layer_idx == state.rope_layer:  # the rotary layers share the table
            state.rope.append(call.position_embeddings)
            state.last_rope = call.position_embeddings

    def _catch_up(self, cache):
        """Add the keys decoded since the last selection to their pages' sums, every layer."""
        state = cache.state
        layers = {i: cache.layers[i] for i in state.columns}
        end = next(iter(layers.values())).logical_len
        if end == state.summed:
            return
        rope = tuple(torch.cat(parts, dim=1) for parts in zip(*state.rope)) if self.pre_rope else None
        for i, layer in layers.items():
            self._accumulate(cache, layer, i, state.summed, None if i in state.unrotated else rope)
        state.summed, state.rope = end, []

    def _accumulate(self, cache, layer, layer_idx, start, rope, end=None, sign=1.0):
        """Add (`sign` -1: take back) the keys of store slots `start:end` of this layer (RoPE undone with `rope` =
        their (cos, sin)) to their blocks' sums; `end` defaults to every token seen."""
        state, end = cache.state, layer.logical_len if end is None else end
        b, h, _, d = layer.store_keys.shape
        first = cache.on("prompt_start", layer.device)[:, None]
        blocks = -(-(end - int(first.min())) // self.page_stride)
        if state.page_sums is None or blocks > state.page_sums.shape[1]:
            grown = torch.zeros(b, blocks + 64, len(state.columns) * h * d, device=layer.device)
            if state.page_sums is not None:
                grown[:, : state.page_sums.shape[1]] = state.page_sums
            state.page_sums = grown
        slots = torch.arange(start, end, device=layer.device)[None, :]
        block = (slots - first).div(self.page_stride, rounding_mode="floor")  # (b, q); < 0: padding
        keys = layer.store_keys[:, :, start:end]
        if self.pre_rope:
            keys = rotate(keys, rope, inverse=True)
        keys = keys.permute(0, 2, 1, 3).reshape(b, end - start, h * d).float()
        keys = keys * ((block >= 0)[..., None] * sign)
        column = state.columns[layer_idx] * h * d
        state.page_sums[:, :, column: column + h * d].scatter_add_(
            1, block.clamp(min=0)[..., None].expand(-1, -1, h * d), keys)

    def crop(self, cache: SparseCache, length: int) -> None:
        """A rejected draft: take its keys back out of the page sums if a selection summed them, forget their
        RoPE, and rebuild a working context planned with them."""
        state = cache.state
        if state.page_sums is None:
            return
        end = cache.layers[next(iter(state.columns))].logical_len
        if state.summed > length:
            rope = None
            if self.pre_rope and state.last_rope is not None:
                first = end - state.last_rope[0].shape[1]  # the last forward's first position
                if length < first:
                    raise ValueError(f"CHESSPress: can only crop the last forward's tokens (from {first}); "
                                     f"asked to crop from {length}.")
                rope = tuple(t[:, length - first: state.summed - first] for t in state.last_rope)
            for i in state.columns:
                self._accumulate(cache, cache.layers[i], i, length, None if i in state.unrotated else rope,
                                 end=state.summed, sign=-1.0)
            state.summed, state.rope = length, []
        elif state.rope:
            cos, sin = (torch.cat(parts, dim=1) for parts in zip(*state.rope))
            state.rope = [(cos[:, : length - state.summed], sin[:, : length - state.summed])]
        if state.plan is not None:
            start = cache.on("prompt_start", state.plan[0].device)
            state.plan = self.working_context(state.selected, length - start, start)

    # --- selection (Algorithm 1) and the working context ---------------------------------------------------------
    def end_forward(self, cache: SparseCache, logits: torch.Tensor) -> None:
        state = cache.state
        if state.page_sums is None:
            return
        start = time.perf_counter()
        layer = cache.layers[next(iter(state.columns))]
        lengths = layer.logical_len - cache.on("prompt_start", layer.device)  # real tokens per row
        # Complete pages per row, from the host's copy of the row starts: compared without a wait for the device.
        complete = (layer.logical_len - cache.prompt_start).div(self.page_size, rounding_mode="floor")
        continued = cache.forward is not None and cache.forward.continues_prompt
        if state.selected is None or continued:  # a prompt, the first or a continued one
            trigger = torch.ones_like(lengths, dtype=torch.bool)
        else:
            state.steps += 1
            trigger = self.triggers(logits[:, -1], state.steps)
        reselect = bool(trigger.any())  # the step's one read on the host (uncertainty needs the logits)
        if reselect:
            self._catch_up(cache)
            fresh = self.blocks_of(self.select(state.page_sums, lengths)[-1])
            state.selected = fresh if state.selected is None else torch.where(
                trigger[:, None], fresh, pad_columns(state.selected, fresh.shape[1]))
            cache.counts["selections"] += int(trigger.sum())
        if reselect or not torch.equal(complete, state.built_at):
            state.plan = self.working_context(state.selected, lengths, cache.on("prompt_start", lengths.device))
            state.built_at = complete
            cache.counts["rebuilds"] += 1
        cache.seconds["select"] += time.perf_counter() - start

    def triggers(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """`(batch,)` which rows re-select after decoding step `step`, from their next-token `logits`."""
        b = logits.shape[0]
        if self.reselect_every is not None:
            return torch.full((b,), step % self.reselect_every == 0, device=logits.device)
        if self.reselect != "uncertainty":
            return torch.full((b,), self.reselect == "always", device=logits.device)
        entropy, varentropy = uncertainty(logits)
        return (entropy > self.entropy_threshold) & (varentropy > self.varentropy_threshold)

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
        pages as blocks; those running past the row's end are no candidates); a candidate's blocks all are."""
        n_blocks = int((-(-lengths // self.page_stride)).max())
        always, candidate = self.block_roles(lengths, n_blocks)
        block = torch.arange(n_blocks, device=lengths.device)
        sums = page_sums[:, :n_blocks]
        if self.span > 1:  # page k: blocks k ... k + span - 1
            sums = nn.functional.pad(sums, (0, 0, 0, self.span - 1)).unfold(1, self.span, 1).sum(-1)
            candidate = nn.functional.pad(candidate, (0, self.span - 1)).unfold(1, self.span, 1).all(-1)
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

    def select(self, page_sums: torch.Tensor, lengths: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Algorithm 1: masks of the selected grids `(batch, grids)`, chunks `(batch, chunks)` and candidate pages
        `(batch, pages)`, for rows of `lengths` real tokens (page k starts at block k: `blocks_of` gives the blocks
        attention reads). Chunks and grids group consecutive pages."""
        vectors, anchor, candidate = self.page_vectors(page_sums, lengths)
        scores = (vectors @ anchor[:, :, None])[..., 0]  # eq. 4 for every page: one GEMM
        return self.select_by(scores, candidate, self.retention_for(lengths))

    def select_by(self, s_page: torch.Tensor, candidate: torch.Tensor, retention: tuple | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Algorithm 1 from the pages' scores `s_page` and the candidate pages, both `(batch, pages)`: as `select`
        (`retention`: `retention_for` the rows, default `retention`)."""
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
            return keep_grid, keep_chunk, top_fraction(s_page, active, rho_p)
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

    def working_context(self, selected: torch.Tensor, lengths: torch.Tensor, prompt_start: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Store slots `(batch, n)` and validity of the blocks of sink + selected + window pages + the partial
        page (`selected`: `(batch, blocks)`), and whether every slot is real (read once here for every layer's
        `gather`)."""
        n_blocks, size = int((-(-lengths // self.page_stride)).max()), self.page_stride
        always, _ = self.block_roles(lengths, n_blocks)
        attended = always | pad_columns(selected, n_blocks)
        # Attended blocks first, in order; then tokens of each block, those past the row's end invalid.
        order = torch.where(attended, torch.arange(n_blocks, device=attended.device), n_blocks).sort(dim=-1).values
        width = int(attended.sum(-1).max())
        blocks = order[:, :width]
        offsets = blocks[..., None] * size + torch.arange(size, device=blocks.device)
        offsets = offsets.flatten(1)  # (b, width * page_stride) token index within the row
        valid = (blocks < n_blocks).repeat_interleave(size, dim=1) & (offsets < lengths[:, None])
        slots = (offsets + prompt_start.to(offsets.device)[:, None]).where(valid, 0)
        return slots, valid, bool(valid.all())

    def begin_forward(self, cache: SparseCache, forward: Forward) -> None:
        state = cache.state
        forward.plan, state.plan = state.plan, None  # a new working context for every layer
        if forward.continues_prompt and state.selected is not None:
            # A continued prompt is a prompt: read densely, as the first one was (and selected for after it).
            # Before transformers builds this forward's mask, which then sees every layer's store layout.
            forward.plan = None
            layer = cache.layers[next(iter(state.columns))]
            start = cache.on("prompt_start", layer.device)[:, None]
            valid = torch.arange(layer.logical_len, device=layer.device) >= start
            for i in state.columns:
                cache.layers[i].read_store(valid)

    def before_attention(self, cache: SparseCache, layer: KVLayer, call: AttentionCall) -> None:
        if cache.forward.plan is not None:
            start = time.perf_counter()
            layer.gather(*cache.forward.plan)
            cache.seconds["gather"] += time.perf_counter() - start

    # --- calibration (sec. 3.3) ------------------------------------------------------------------------------
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


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean of `x` over `dim` where `mask` (x's shape without the last dimension) is True; 0 where none is."""
    weight = mask.to(x.dtype)[..., None]
    return (x * weight).sum(dim) / weight.sum(dim).clamp(min=1)


def top_fraction(scores: torch.Tensor, active: torch.Tensor, rho: float | torch.Tensor) -> torch.Tensor:
    """Active entries at or above the `1 - rho` quantile of the active scores of their row (Algorithm 1); `rho`
    one fraction, or one per row `(batch,)` (a budget), interpolated as `torch.quantile` does."""
    if not isinstance(rho, torch.Tensor):
        threshold = scores.masked_fill(~active, float("nan")).nanquantile(1 - rho, dim=-1, keepdim=True)
        return active & (scores >= threshold)
    ranked = scores.masked_fill(~active, float("inf")).sort(dim=-1).values  # the active ones first, ascending
    at = ((1 - rho.to(scores.device)) * (active.sum(-1) - 1).clamp(min=0))[:, None]  # (batch, 1), fractional
    low, high = (ranked.gather(-1, i.long().clamp(min=0)) for i in (at.floor(), at.ceil()))
    threshold = low + (at - at.floor()).to(scores.dtype) * (high - low)
    return active & (scores >= threshold)


def top_covering(scores: torch.Tensor, active: torch.Tensor, budget: torch.Tensor, span: int) -> torch.Tensor:
    """Active pages `(batch, pages)`, best first, while the blocks they cover number at most `budget` `(batch,)`
    (page k covers blocks k ... k + span - 1; the best page at least): Algorithm 1's last level when pages overlap."""
    b, n = scores.shape
    order = scores.masked_fill(~active, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=order.device).expand(b, n))
    rank = rank.masked_fill(~active, n)  # never taken
    # A block is attended once the best-ranked page over it is taken: taking the pages ranked below t attends the
    # blocks whose first rank is below t, so t is the budget-th smallest first rank (at least 1: the best page).
    first = nn.functional.pad(rank, (span - 1, 0), value=n).unfold(1, span, 1).amin(-1)  # (b, blocks)
    limit = first.sort(dim=-1).values.gather(-1, budget.clamp(max=n - 1)[:, None]).clamp(min=1)
    return active & (rank < limit)


def pad_columns(mask: torch.Tensor, n: int) -> torch.Tensor:
    """A per-page or per-block `mask` `(batch, columns)` padded with False to `n` columns: the pages or blocks that
    appeared since it was made."""
    return torch.nn.functional.pad(mask, (0, n - mask.shape[1]))
