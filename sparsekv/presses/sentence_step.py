"""SentenceKV's executor: which store tokens enter a layer's working set (`load`), and `rank_at="step"`,
which ranks and loads every layer's sentences at once before a step (`rank_step`), over the stack of their
states (`LayerStack`): on the host, copying only the tokens entering (`load_all`), or, where a compiled step
cannot read the host without a wait, in its graph, writing whole loaded regions (`load_region`). The algorithm
it executes is `sparsekv.presses.sentencekv`'s."""

from __future__ import annotations

import torch

from ..cache import SparseCache
from ..store import load_layers
from .sentence_state import LayerStack


def load(layer, stack: LayerStack, rank: int, chosen: torch.Tensor, one_read: bool | None = None,
         first: bool = False) -> None:
    """Make the store slots `chosen` `(b, h, R)` the loaded ones of the layer at `rank` in `stack`, copying only
    those not resident yet (one gather from the store and one write per tensor, every head at once); in a stack
    without `device_slot` (a compiled step that loads in its graph), the whole loaded region (`load_region`).
    `first`: at compress, the loaded region is free and the chosen slots fill it from the front (uncounted).

    Each entering token takes the device slot of one that leaves: every head holds `fill` chosen slots, so
    per head as many leave as enter and, listed in the same (row, head) order, they pair up. Attention does
    not care about slot order (keys carry their RoPE), so the loaded region needs none.
    """
    resident = stack.resident[:, rank]  # views: written in place
    device_slot = None if stack.device_slot is None else stack.device_slot[:, rank]  # (None: loads in the graph)
    if not first:
        count(stack, chosen[:, None], resident[:, None])
    if device_slot is None and not first:
        load_region([layer], chosen[:, None], resident[:, None])
        return
    if one_read is None:  # on a CPU a host read costs an op; on a GPU each waits for the device to drain
        one_read = chosen.device.type != "cpu"
    if first:
        row, head, slot = chosen.nonzero().unbind(-1)
        target = (chosen.cumsum(-1) - 1)[chosen]
    elif not one_read:
        row, head, slot = (chosen > resident).nonzero().unbind(-1)
        target = device_slot[resident > chosen]  # the slots of those that leave
    else:
        # Those that enter (chosen, not resident) and those that leave, found by one `nonzero` (one read on
        # the host): as many of each per head, so the first half of its rows enters, the second leaves.
        pairs = torch.stack([chosen > resident, resident > chosen]).nonzero()
        n = pairs.shape[0] // 2
        _, row, head, slot = pairs[:n].unbind(-1)
        _, *leaving = pairs[n:].unbind(-1)
        target = device_slot[tuple(leaving)]  # the slots of those that leave
    resident.copy_(chosen)
    if slot.numel() == 0:  # the selection did not change: everything is resident already
        return
    load_layers([layer], None, row, head, slot, target)
    if device_slot is not None:
        device_slot[row, head, slot] = target


def rank_step(press, cache: SparseCache, stacks: list[LayerStack]) -> None:
    """Rank and load every compressed layer's sentences for the forward about to run, from the sums of the
    queries so far (`rank_at="step"`): one stack of `stacks` (of `cache.state`'s) at a time (one per device). A
    stack with `device_slot` loads the tokens entering (`load_all`, found on the host), one without writes its
    whole loaded regions (`load_region`, in a compiled step's graph)."""
    for stack in stacks:
        chosen = press.chosen(stack)
        # A row whose sentence has no token yet (just ended; or `prompt_sentence=False`) keeps its selection.
        empty = (stack.query_sum == 0).flatten(1).all(1)
        chosen = torch.where(empty[:, None, None, None], stack.resident, chosen)
        count(stack, chosen, stack.resident)
        layers = [cache.layers[i] for i in stack.ranks]  # in rank order
        if stack.device_slot is None:
            load_region(layers, chosen, stack.resident)
        else:
            load_all(layers, stack, chosen)


def load_all(layers: list, stack: LayerStack, chosen: torch.Tensor) -> None:
    """`load` for every layer of `stack` (`layers`, in rank order) at once: the slots entering and leaving each
    layer's selection found by one `nonzero` over the stack (one read on the host; layers first, so each layer's
    are consecutive), then each layer whose selection changed loads its own."""
    resident, stack.resident = stack.resident, chosen
    pairs = torch.stack([chosen > resident, resident > chosen]).transpose(1, 2).nonzero()
    n = pairs.shape[0] // 2  # as many leave as enter, per layer, row and head: they pair up in order
    if n == 0:
        return
    _, lay, row, head, slot = pairs[:n].unbind(-1)
    _, lay_out, row_out, head_out, slot_out = pairs[n:].unbind(-1)
    target = stack.device_slot[row_out, lay_out, head_out, slot_out]  # the slots of those that leave
    stack.device_slot[row, lay, head, slot] = target
    load_layers(layers, lay, row, head, slot, target)


def load_region(layers: list, chosen: torch.Tensor, resident: torch.Tensor) -> None:
    """`load` on a compiled cache's layers, whose steps keep their shapes and read nothing on the host: each
    layer's whole loaded region written anew, in place, with the chosen store slots `chosen` `(b, layers, h, R)`
    in order of position (`StoreLayer.load_region`; a row filling fewer has its fillers written with store slot 0,
    never attended); `resident` (of the same shape, a view of the stack's) written in place to match. Each chosen
    slot's place is a count of those before it, not a sort; being that count, it is not kept (a compiled cache
    has no `device_slot`)."""
    place = chosen.cumsum(-1) - 1  # (b, layers, h, R): the region slot of each chosen store slot
    r = chosen.shape[-1]
    slots = place.new_zeros(*place.shape[:-1], r + 1).scatter_(  # unchosen slots to a last column, dropped
        -1, torch.where(chosen.bool(), place, r), torch.arange(r, device=place.device).expand_as(place))
    for layer, layer_slots in zip(layers, slots.unbind(1)):
        layer.load_region(layer_slots)
    resident.copy_(chosen)


def count(stack: LayerStack, chosen: torch.Tensor, resident: torch.Tensor) -> None:
    """Count a ranking of layers `chosen` `(b, layers, h, R)` (against `resident`) in each row's `stack.counts`,
    on the device: one selection per layer, one load per layer whose selection changed, and the tokens entering."""
    entering = (chosen > resident).flatten(2).sum(-1)  # (b, layers)
    stack.counts.add_(torch.stack([torch.full_like(entering[:, 0], entering.shape[1]), (entering > 0).sum(1),
                                   entering.sum(1)], dim=1))


def loading_room(slot_sentence: torch.Tensor, sizes: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Per store slot `(b, 1, R)`, the bound under which the stored tokens of the sentences ranked up to its own
    (its own included: `through`) must stay for the slot to be loaded: `fill + size - rank`, i.e. the tokens
    ranked before the slot, `through - size + rank`, are fewer than `fill`. 0 for empty slots: never loaded.

    `slot_sentence` `(b, 1, R)` is sorted by position within each sentence; `sizes` `(b, 1, S)` counts each
    sentence's stored tokens; `fill` `(b, 1, 1)` the loaded slots of each row.
    """
    rank = rank_in_sentence(slot_sentence, sizes.shape[-1])
    size = sizes.gather(-1, slot_sentence)
    return torch.where(rank < size, fill + size - rank, 0)


def rank_in_sentence(sentence: torch.Tensor, n_sentences: int) -> torch.Tensor:
    """For slots sorted by position with sentence ids `sentence` `(..., R)` in [0, n_sentences), each slot's index
    among the slots of its sentence."""
    order = sentence.argsort(dim=-1, stable=True)  # grouped by sentence, by position within a sentence
    sizes = torch.zeros(*sentence.shape[:-1], n_sentences, dtype=torch.long, device=sentence.device)
    sizes.scatter_add_(-1, sentence, torch.ones_like(sentence))
    first = sizes.cumsum(-1) - sizes  # index in `order` of each sentence's first slot
    ranks = torch.arange(sentence.shape[-1], device=sentence.device) - first.gather(-1, sentence.gather(-1, order))
    return torch.empty_like(ranks).scatter_(-1, order, ranks)
