"""CHESS's pages, what `sparsekv.presses.chess` reads and plans: the per-block sums of every layer's keys, current
after every forward (eq. 1's inputs; `accumulate`, `add_forward_keys`, `take_back`), the working context attention
reads, the store slots of the attended blocks (`working_context`), and a compiled cache's fixed shapes
(`plan_steps`).

Eager and compiled decoding steps run the same code (`CHESSPress.end_forward`); a compiled cache's differs in
what is fixed for the whole generation, planned once after its prompt: each layer's store has room for every
token to come, the page sums and selection span every block a row can reach, and the working context has a
fixed width, what a row can attend (the sink, window and partial pages, and the most blocks a selection can
hold, `most_selected`; slots a row does not fill are free, masked). A step's token takes the first free slot, where
an eager step appends it: the same tokens attended, in the same order. An eager step reads its trigger on the host
and runs Algorithm 1 when a row's fires, taken in those rows, and gathers its working context when the window
slides or a selection changes it; so does a compiled cache on a CPU, between its steps (`select_between_steps`:
the host reads the trigger without a wait there). Where a host read waits for the device, a compiled step runs
Algorithm 1 at every step in its graph, taken where the trigger fires, and gathers its working context anew."""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import torch

from ..attention import rotate
from ..state import RowState


@dataclass
class CHESSState(RowState):
    """Per generation: the page vectors of every compressed layer and the current selection.

    Attributes:
        page_sums: `(batch, blocks, D)` float32, per block of `page_stride` tokens the sum of its keys; columns
            are (layer, KV head, dim) flattened (eq. 1), each layer filling its own columns. Block k of a row covers
            the tokens `start + k * page_stride ...` of that row, `start` its first real token, so padding is in
            no block; page k is blocks `k ... k + page_size / page_stride - 1` (one block when pages do not overlap).
            Current after every forward (`accumulate` at the prompt, `add_forward_keys` after it).
        columns: layer index -> its rank among the compressed layers (its block of columns in `page_sums`).
        selected: `(batch, blocks)` blocks of the pages chosen by the last selection (Algorithm 1).
        context: `(slots, valid, all_valid)`: `(batch, n)` store slots of the working context the next forward
            reads, which of them are real, and whether all are (`working_context`).
        fresh: whether the next forward's layers gather `context` (`CHESSPress.choose`): after a forward that
            changed it; a compiled cache's every step where its graph rewrites it in place (not on a CPU). Else a
            layer keeps its working set, and the step's token joins it.
        built_at: `(batch,)` complete pages when the working context was last built (the window slides when
            a page completes), on the CPU.
        steps: `(batch,)` decoding steps since the prompt (`reselect_every` counts them), on the device.
        triggered: `(batch,)` a compiled cache's rows whose trigger fired at its last step, on a CPU, where the
            next step's `select_between_steps` reads it (`plan_steps`; None on other caches).
        most, reach: a compiled cache's `(batch,)` most blocks a selection holds (`most_selected`) and the
            positions its steps may write (below `reach`: the prompt's and `max_new_tokens`), planned after its
            prompt (`plan_steps`; its working context's width is `context`'s); None on other caches.
        selections: `(batch,)` the selections each row made (Algorithm 1 run and taken), its prompts' included,
            counted on the device by eager and compiled steps alike; `stats().counts["selections"]` sums them.
        last_rope: the `(cos, sin)` of the last forward, to take a rejected draft's keys back out (`crop`).
        rope_layer: the first compressed layer whose keys carry RoPE, which records the forward's `(cos, sin)` for
            all of them (they share the rotary table); None when none does. `unrotated`: the layers whose keys do
            not (NoPE layers).
    """

    page_sums: torch.Tensor | None = None
    columns: dict[int, int] = field(default_factory=dict)
    selected: torch.Tensor | None = None
    context: tuple[torch.Tensor, torch.Tensor, bool] | None = None
    fresh: bool = False
    built_at: torch.Tensor | None = None
    steps: torch.Tensor | None = None
    triggered: torch.Tensor | None = None
    most: torch.Tensor | None = None
    reach: torch.Tensor | None = None
    selections: torch.Tensor | None = None
    last_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    rope_layer: int | None = None
    unrotated: set[int] = field(default_factory=set)

    def event_counts(self) -> dict[str, int]:
        return {} if self.selections is None else {"selections": int(self.selections.sum())}


def accumulate(press, cache, layer, layer_idx: int, start: int, rope, end: int | None = None, sign: float = 1.0
               ) -> None:
    """Add (`sign` -1: take back) the keys of store slots `start:end` of this layer (RoPE undone with `rope` =
    their (cos, sin)) to their blocks' sums; `end` defaults to every token seen."""
    state, end = cache.state, layer.logical_len if end is None else end
    b, h, _, d = layer.store_keys.shape
    first = cache.on("prompt_start", layer.keys.device)[:, None]
    grow_sums(press, cache, end - int(first.min()), layer.keys.device, len(state.columns) * h * d)
    slots = torch.arange(start, end, device=layer.keys.device)[None, :]
    block = (slots - first).div(press.page_stride, rounding_mode="floor")  # (b, q); < 0: padding
    keys = layer.store_keys[:, :, start:end]
    if press.pre_rope:
        keys = rotate(keys, rope, inverse=True)
    keys = keys.permute(0, 2, 1, 3).reshape(b, end - start, h * d).float()
    keys = keys * ((block >= 0)[..., None] * sign)
    column = state.columns[layer_idx] * h * d
    state.page_sums[:, :, column: column + h * d].scatter_add_(
        1, block.clamp(min=0)[..., None].expand(-1, -1, h * d), keys)


def grow_sums(press, cache, tokens: int, device: torch.device, width: int) -> None:
    """Room in the page sums for rows of up to `tokens` tokens: eagerly, grown on the host when a forward reaches
    their end (64 blocks at a time); a compiled cache's steps have theirs planned (`plan_steps`)."""
    state = cache.state
    blocks = -(-tokens // press.page_stride)
    if state.page_sums is None or blocks > state.page_sums.shape[1]:
        grown = torch.zeros(len(cache.on("prompt_start", device)), blocks + 64, width, device=device)
        if state.page_sums is not None:
            grown[:, : state.page_sums.shape[1]] = state.page_sums
        state.page_sums = grown


def add_forward_keys(press, cache, q: int, rope) -> torch.Tensor:
    """A forward after the prompt: the keys of its `q` tokens join their blocks' sums, every compressed layer's
    in one add, eager and compiled alike (eq. 1's inputs current after every forward). `rope`: the forward's
    (cos, sin), to undo RoPE (`pre_rope`). Returns the tokens' store slots `(batch, q)`, read where they are (a
    compiled step's on the device)."""
    state = cache.state
    layer_keys = {i: cache.layers[i].last_keys(q) for i in state.columns}
    layer = cache.layers[next(iter(state.columns))]  # (every compressed layer holds the same tokens)
    slots = layer.last_slots(q)
    if state.unrotated:  # NoPE layers among them: RoPE undone layer by layer, where it was applied
        keys = torch.cat([rotate(k, None if i in state.unrotated or not press.pre_rope else rope, inverse=True)
                          for i, k in layer_keys.items()], dim=1)
    else:  # every layer's keys at once (`(batch, layers * kv_heads, q, head_dim)`, in column order): one rotation
        keys = rotate(torch.cat(list(layer_keys.values()), dim=1), rope if press.pre_rope else None, inverse=True)
    keys = keys.permute(0, 2, 1, 3).flatten(2).float()  # (batch, q, columns)
    start = cache.on("prompt_start", slots.device)
    if state.reach is None:  # eagerly, the sums grow to the forward's last token (read on the host)
        grow_sums(press, cache, layer.logical_len - int(cache.on("prompt_start", "cpu").min()), slots.device,
                  keys.shape[-1])
    else:  # a compiled cache's: past the planned positions, an error, never a window cut short
        torch._assert_async((slots < state.reach[:, None]).all(), "sparsekv: a compiled CHESS cache has no room "
                            "left for the next step's context (it decoded the tokens it was made for): make it "
                            "with max_new_tokens at least generate's (`make_cache(model, compiled=True, "
                            "max_new_tokens=...)`).")
    block = (slots - start[:, None]).div(press.page_stride, rounding_mode="floor")
    if q == 1:  # an indexed add, which inductor makes in place (a scatter_add_ it makes on a copy of the sums)
        rows = torch.arange(len(block), device=block.device)
        state.page_sums.index_put_((rows, block[:, 0]), keys[:, 0], accumulate=True)
    else:  # several tokens may share a block: added in order, as one at a time would be
        state.page_sums.scatter_add_(1, block[..., None].expand(-1, -1, keys.shape[-1]), keys)
    return slots


def take_back(press, cache, length: int) -> None:
    """A rejected draft (tokens from `length` on): its keys leave the page sums."""
    state = cache.state
    if state.page_sums is None:
        return
    end = cache.layers[next(iter(state.columns))].logical_len
    rope = None
    if press.pre_rope and state.last_rope is not None:
        first = end - state.last_rope[0].shape[1]  # the last forward's first position
        if length < first:
            raise ValueError(f"CHESSPress: can only crop the last forward's tokens (from {first}); "
                             f"asked to crop from {length}.")
        rope = tuple(t[:, length - first:] for t in state.last_rope)
    for i in state.columns:
        accumulate(press, cache, cache.layers[i], i, length, None if i in state.unrotated else rope, end=end,
                   sign=-1.0)


def working_context(press, selected: torch.Tensor, lengths: torch.Tensor, prompt_start: torch.Tensor,
                    width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, bool | None]:
    """Store slots `(batch, n)` and validity of the blocks of sink + selected + window pages + the partial
    page (`selected`: `(batch, blocks)`), and whether every slot is real (read once here for every layer's
    `gather`). `width`: blocks per row, a compiled step's fixed width (`selected` then spans every block a row
    reaches, and nothing is read on the host: whether every slot is real is False, masked at every step); None:
    the widest row's."""
    size, fixed = press.page_stride, width is not None
    n_blocks = selected.shape[1] if fixed else int((-(-lengths // size)).max())
    always, _ = press.block_roles(lengths, n_blocks)
    attended = always | pad_columns(selected, n_blocks)
    # Attended blocks first, in order; then tokens of each block, those past the row's end invalid.
    order = torch.where(attended, torch.arange(n_blocks, device=attended.device), n_blocks).sort(dim=-1).values
    if width is None:
        width = int(attended.sum(-1).max())
    blocks = order[:, :width]
    offsets = blocks[..., None] * size + torch.arange(size, device=blocks.device)
    offsets = offsets.flatten(1)  # (b, width * page_stride) token index within the row
    valid = (blocks < n_blocks).repeat_interleave(size, dim=1) & (offsets < lengths[:, None])
    slots = (offsets + prompt_start.to(offsets.device)[:, None]).where(valid, 0)
    return slots, valid, False if fixed else bool(valid.all())


def plan_context(press, cache, lengths: torch.Tensor, start: torch.Tensor, reselect: bool, width: int | None) -> bool:
    """The next forward's working context (`state.context`), made anew when a selection or the window changed it
    (the window slides when a page completes); `width`: a compiled cache's (`working_context`). Returns whether it
    was."""
    state = cache.state
    layer = cache.layers[next(iter(state.columns))]
    # Complete pages per row, from the host's copy of the row starts: compared without a wait for the device.
    complete = (layer.logical_len - cache.on("prompt_start", "cpu")).div(press.page_size, rounding_mode="floor")
    if not reselect and torch.equal(complete, state.built_at):
        return False
    state.context = working_context(press, state.selected, lengths, start, width)
    state.built_at = complete
    cache.counts["rebuilds"] += 1
    return True


def read_stores(cache) -> None:
    """A continued prompt (a question asked of a compressed context) reads every token, as the first prompt did,
    and is selected for after it: the layers read their stores, before transformers builds the forward's mask."""
    state = cache.state
    state.fresh = False
    layer = cache.layers[next(iter(state.columns))]
    start = cache.on("prompt_start", layer.keys.device)[:, None]
    valid = torch.arange(layer.logical_len, device=layer.keys.device) >= start
    for i in state.columns:
        cache.layers[i].gather(None, valid)


def budget_retention(press, lengths: torch.Tensor, n_blocks: int) -> tuple:
    """CHESS's `read_budget` as retention ratios per row `(batch,)`: the fraction of a row's candidate tokens that
    fills the budget beside the tokens always attended (sink, window and partial pages), split evenly over the levels as
    `ratio` is; 1 when everything fits. `n_blocks`: the grid's blocks (at least every row's)."""
    always, candidate = press.block_roles(lengths, n_blocks)
    start = torch.arange(n_blocks, device=lengths.device) * press.page_stride
    tokens = (lengths[:, None] - start).clamp(0, press.page_stride)  # (batch, blocks)
    spare = (press.read_budget - (tokens * always).sum(-1)).clamp(min=1)
    fraction = (spare / (tokens * candidate).sum(-1).clamp(min=1)).clamp(max=1.0).double()
    return (fraction ** (1 / 3),) * 3


def pad_columns(mask: torch.Tensor, n: int) -> torch.Tensor:
    """A per-page or per-block `mask` `(batch, columns)` padded with False to `n` columns: the pages or blocks that
    appeared since it was made."""
    return torch.nn.functional.pad(mask, (0, n - mask.shape[1]))


def plan_steps(press, cache, lengths: torch.Tensor) -> int:
    """After a prompt on a compiled cache, with its selection made: the steps' fixed shapes (the page sums and
    selection over every block a row can reach). Returns the working context's width, in blocks."""
    state = cache.state
    positions = cache.layers[next(iter(state.columns))].logical_len + cache.max_new_tokens  # (ints, not symbols)
    state.reach = torch.full_like(lengths, positions)
    state.triggered = torch.zeros_like(lengths, dtype=torch.bool)
    reachable = -(-positions // press.page_stride)  # blocks a row can reach
    n_blocks = max(reachable, state.page_sums.shape[1])
    state.page_sums = torch.nn.functional.pad(state.page_sums, (0, 0, 0, n_blocks - state.page_sums.shape[1]))
    state.selected = pad_columns(state.selected, n_blocks)
    most = most_selected(press, reachable)
    state.most = torch.full_like(lengths, most)
    always = (press.sink_pages + press.window_pages + 1) * press.span  # blocks: the partial page has `span`
    return min(reachable, always + most)


def most_selected(press, n_blocks: int) -> int:
    """The most blocks a selection can hold, on rows of at most `n_blocks` blocks: a compiled step's width
    beside the blocks always attended. With overlapping pages, Algorithm 1's last level covers a number of
    blocks (`top_covering`); with pages one after the other, each level keeps at most `rho (n - 1) + 1` of `n`
    entries (a quantile), except entries tied at it, which `select_by` leaves out past this number."""
    stride, span = press.page_stride, press.span
    group = press.chunk_pages * press.grid_chunks  # pages per grid
    if press.read_budget is not None:  # a fraction of the candidates' blocks that fills at most read_budget tokens
        fits = -(-press.read_budget // stride) + 1
        # Pages one after the other: each level's quantile keeps at most one entry more than its fraction, and
        # a kept grid or chunk brings all its children: at most 3 grids' and a chunk's pages beyond the budget.
        most = max(fits, span) + span if span > 1 else fits + 3 * group + press.chunk_pages + 1
        return min(n_blocks, most)
    rho_g, rho_c, rho_p = press.retention
    if span > 1:
        return min(n_blocks, max(span, math.ceil(rho_g * rho_c * rho_p * n_blocks)) + span)

    def kept(n: int, rho: float) -> int:  # entries at or above the 1 - rho quantile of n distinct ones
        return min(n, math.floor(rho * (n - 1) + 1e-9) + 1)

    grids = kept(-(-n_blocks // group), rho_g)
    chunks = kept(grids * press.grid_chunks, rho_c)
    return min(n_blocks, kept(chunks * press.chunk_pages, rho_p) + 1)
