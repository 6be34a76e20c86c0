"""CHESS's decoding step on a compiled cache (`make_cache(model, compiled=True, max_new_tokens=...)`), the executor
of `sparsekv.presses.chess` that generate's compiled step traces once: the selection `CHESSPress.end_forward`
makes, over shapes fixed for the whole generation, with nothing read on the host.

What differs from an eager step, and why:

- Each layer's store has room for every token to come, and a step writes its token there at its position, found
  on the device (`StoreLayer.make_step_room`, `_record_step`).
- The working set is a fixed number of context slots and the step's slot. Its width (`plan_steps`) is what a
  row can attend: the sink, window and partial pages, and the most blocks a selection can hold
  (`most_selected`); slots a row does not fill are masked. The context is gathered anew from the store at every
  step (`CHESSPress.choose`, `StoreLayer.gather_in_place`), where the eager step gathers it when the window
  slides or a selection changes it and appends tokens in between: the same tokens attended, in the same order.
  (What is written in place is written before it is read, the store and the page sums: inductor copies a tensor
  whole at every step to keep a value read before a write.)
- The step's keys join the page sums at once, every layer in one add, where the eager step sums them when a
  selection reads the sums (`catch_up`); added in the same order, so the sums are the same.
- Algorithm 1 runs at every step, and its selection is taken in the rows whose uncertainty trigger fires
  (`torch.where`), where the eager step reads the trigger on the host and selects only then. Both count the
  selections taken on the device (`CHESSState.selections`).
"""

from __future__ import annotations

import math

import torch

from ..attention import rotate
from .chess_pages import pad_columns


def plan_steps(press, cache, lengths: torch.Tensor) -> None:
    """After a prompt on a compiled cache, with its selection made: the steps' fixed shapes (the page sums and
    selection over every block a row can reach, the working context's width) and each layer's first working set,
    gathered now, so that the driver's `ready_for_steps` adds the step's slot to it."""
    state = cache.state
    layers = [cache.layers[i] for i in state.columns]
    positions = layers[0].logical_len + cache.max_new_tokens  # (ints a step reads would be traced as symbols)
    state.reach = torch.full_like(lengths, positions)
    reachable = -(-positions // press.page_stride)  # blocks a row can reach
    n_blocks = max(reachable, state.page_sums.shape[1])
    state.page_sums = torch.nn.functional.pad(state.page_sums, (0, 0, 0, n_blocks - state.page_sums.shape[1]))
    state.selected = pad_columns(state.selected, n_blocks)
    most = most_selected(press, reachable)
    state.most = torch.full_like(lengths, most)
    always = (press.sink_pages + press.window_pages + 1) * press.span  # blocks: the partial page has `span`
    slots, valid, _ = press.working_context(state.selected, lengths, cache.on("prompt_start", lengths.device),
                                            min(reachable, always + most))
    state.context, state.next_context = (slots, valid), None
    for layer in layers:
        layer.gather(slots, valid, all_valid=False)  # (masked every step: which slots are real changes)


def end_step(press, cache, logits: torch.Tensor) -> None:
    """After a decoding step on a compiled cache: its keys into the page sums, the trigger, Algorithm 1 where it
    fires, and the next step's working context, all in place."""
    state = cache.state
    layers = {i: cache.layers[i] for i in state.columns}
    _, position = next(iter(layers.values())).step_token()
    start = cache.on("prompt_start", position.device)
    lengths = position + 1 - start  # real tokens per row, this step's included
    # Past the planned positions, the next context would not fit its width: an error, never a window cut short.
    torch._assert_async((position < state.reach).all(), "sparsekv: a compiled CHESS cache has no room left for "
                        "the next step's context (it decoded the tokens it was made for): make it with "
                        "max_new_tokens at least generate's (`make_cache(model, compiled=True, max_new_tokens=...)`).")
    rope = cache.forward.plan if press.pre_rope else None  # the step's (cos, sin) (`CHESSPress.after_step`)
    keys = torch.cat([rotate(layer.step_token()[0], None if i in state.unrotated else rope, inverse=True)
                      .permute(0, 2, 1, 3).flatten(2) for i, layer in layers.items()], dim=-1).float()
    block = (lengths - 1).div(press.page_stride, rounding_mode="floor")
    # Eq. 1's sums. (An indexed add, which inductor makes in place; a scatter_add_ it makes on a copy of the sums.)
    rows = torch.arange(len(block), device=block.device)
    state.page_sums.index_put_((rows, block), keys[:, 0], accumulate=True)
    state.steps.add_(1)
    if press.reselect_every is not None or press.reselect != "never":
        trigger = press.triggers(logits[:, -1], state.steps)
        fresh = press.blocks_of(press.select(state.page_sums, lengths, state.most)[-1])
        state.selected.copy_(torch.where(trigger[:, None], fresh, state.selected))
        state.selections.add_(trigger)
    width = state.context[0].shape[1] // press.page_stride  # (a size, constant in the graph)
    slots, valid, _ = press.working_context(state.selected, lengths, start, width)
    state.context[0].copy_(slots)
    state.context[1].copy_(valid)


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
