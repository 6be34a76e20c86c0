"""CHESS's page store, the executor of `sparsekv.presses.chess`: the per-block sums of every layer's keys, kept
current with the decoded keys (eq. 1's inputs; `accumulate`, `catch_up`, `take_back`), and the working context
attention reads, the store slots of the attended blocks (`working_context`)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
        columns: layer index -> its rank among the compressed layers (its block of columns in `page_sums`).
        selected: `(batch, blocks)` blocks of the pages chosen by the last selection (Algorithm 1).
        next_context: `(slots, valid, all_valid)`: `(batch, n)` store slots of a new working context, which of them
            are real, and whether all are; made after a forward, gathered by every layer of the next one; None when
            the context did not change.
        built_at: `(batch,)` complete pages when the working context was last built (the window slides when
            a page completes), on the CPU.
        steps: `(batch,)` decoding steps since the prompt (`reselect_every` counts them), on the device.
        context: a compiled cache's `(slots, valid)`, `(batch, width * page_stride)`: the working context of its
            next step, rewritten in place after every step (`chess_steps`); None on a cache not made compiled.
        most, reach: a compiled cache's `(batch,)` most blocks a selection holds (`chess_steps.most_selected`)
            and the positions its steps may write (below `reach`: the prompt's and `max_new_tokens`); its
            working context's width is `context`'s.
        selections: `(batch,)` the selections each row made (Algorithm 1 run and taken), its prompts' included,
            counted on the device by eager and compiled steps alike; `stats().counts["selections"]` sums them.
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
    next_context: tuple[torch.Tensor, torch.Tensor, bool] | None = None
    built_at: torch.Tensor | None = None
    steps: torch.Tensor | None = None
    context: tuple[torch.Tensor, torch.Tensor] | None = None
    most: torch.Tensor | None = None
    reach: torch.Tensor | None = None
    selections: torch.Tensor | None = None

    def event_counts(self) -> dict[str, int]:
        return {} if self.selections is None else {"selections": int(self.selections.sum())}
    summed: int = 0
    rope: list = field(default_factory=list)
    last_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    rope_layer: int | None = None
    unrotated: set[int] = field(default_factory=set)


def accumulate(press, cache, layer, layer_idx: int, start: int, rope, end: int | None = None, sign: float = 1.0
               ) -> None:
    """Add (`sign` -1: take back) the keys of store slots `start:end` of this layer (RoPE undone with `rope` =
    their (cos, sin)) to their blocks' sums; `end` defaults to every token seen."""
    state, end = cache.state, layer.logical_len if end is None else end
    b, h, _, d = layer.store_keys.shape
    first = cache.on("prompt_start", layer.keys.device)[:, None]
    blocks = -(-(end - int(first.min())) // press.page_stride)
    if state.page_sums is None or blocks > state.page_sums.shape[1]:
        grown = torch.zeros(b, blocks + 64, len(state.columns) * h * d, device=layer.keys.device)
        if state.page_sums is not None:
            grown[:, : state.page_sums.shape[1]] = state.page_sums
        state.page_sums = grown
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


def catch_up(press, cache) -> None:
    """Add the keys decoded since the last selection to their pages' sums, every layer."""
    state = cache.state
    layers = {i: cache.layers[i] for i in state.columns}
    end = next(iter(layers.values())).logical_len
    if end == state.summed:
        return
    rope = tuple(torch.cat(parts, dim=1) for parts in zip(*state.rope)) if press.pre_rope else None
    for i, layer in layers.items():
        accumulate(press, cache, layer, i, state.summed, None if i in state.unrotated else rope)
    state.summed, state.rope = end, []


def take_back(press, cache, length: int) -> None:
    """A rejected draft (tokens from `length` on): take its keys back out of the page sums if a selection summed
    them, and forget their RoPE."""
    state = cache.state
    if state.page_sums is None:
        return
    end = cache.layers[next(iter(state.columns))].logical_len
    if state.summed > length:
        rope = None
        if press.pre_rope and state.last_rope is not None:
            first = end - state.last_rope[0].shape[1]  # the last forward's first position
            if length < first:
                raise ValueError(f"CHESSPress: can only crop the last forward's tokens (from {first}); "
                                 f"asked to crop from {length}.")
            rope = tuple(t[:, length - first: state.summed - first] for t in state.last_rope)
        for i in state.columns:
            accumulate(press, cache, cache.layers[i], i, length, None if i in state.unrotated else rope,
                             end=state.summed, sign=-1.0)
        state.summed, state.rope = length, []
    elif state.rope:
        cos, sin = (torch.cat(parts, dim=1) for parts in zip(*state.rope))
        state.rope = [(cos[:, : length - state.summed], sin[:, : length - state.summed])]


def working_context(press, selected: torch.Tensor, lengths: torch.Tensor, prompt_start: torch.Tensor,
                    width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, bool | None]:
    """Store slots `(batch, n)` and validity of the blocks of sink + selected + window pages + the partial
    page (`selected`: `(batch, blocks)`), and whether every slot is real (read once here for every layer's
    `gather`). `width`: blocks per row, a compiled step's fixed width (`selected` then spans every block a row
    reaches, and nothing is read on the host: whether every slot is real is None); None: the widest row's."""
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
    return slots, valid, None if fixed else bool(valid.all())


def read_stores(cache) -> None:
    """A continued prompt (a question asked of a compressed context) reads every token, as the first prompt did,
    and is selected for after it: the layers read their stores, before transformers builds the forward's mask."""
    state = cache.state
    state.next_context = None
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
