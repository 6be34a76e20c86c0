"""A decoding step under a press as `torch.compile` traces it (what generate's `compile_config` compiles): the
model's forward with the press's hooks and work inside it."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import re
from typing import ClassVar

import conftest
import pytest
import torch
from conftest import byte_tokenizer, greedy, make_model, make_tokenizer, prompt
from torch._dynamo.utils import counters
from transformers import CompileConfig

from sparsekv import (
    AdaKVPress, CHESSPress, ChunkPress, ExpectedAttentionPress, H2OPress, KeyDiffPress, KnormPress, KVzipPress,
    PyramidKVPress, SentencePress, SnapKVPress, StoreLayer, StreamingLLMPress, TOVAPress, compile_config,
)
from sparsekv.layers import KVLayer
from sparsekv.presses import chess, sentencekv

PRESSES = [StreamingLLMPress(ratio=0.25, window_size=1), H2OPress(ratio=0.25, window_size=1),
           SnapKVPress(ratio=0.25, window_size=8), ChunkPress(ratio=0.25, window_size=8, chunk_size=4),
           TOVAPress(ratio=0.25, min_budget=8)]


@pytest.mark.parametrize("press", PRESSES, ids=lambda p: p.label())
@torch.no_grad()
def test_a_decoding_step_traces_without_a_graph_break(press):
    """dynamo traces a decoding step, the hooks and the press's work included (an eviction on a full cache, or the
    token appended to a compressed prompt), without a graph break: the driver takes no clock while compiling,
    makes nothing dynamo cannot construct, and a layer appends by concatenation (the room behind a tensor is read
    from its storage, which dynamo cannot follow). The step gives the eager step's logits and leaves the same
    cache. (CHESS's step reads its trigger on the host, and SentenceKV's finds the tokens entering its selection
    there: both compile on a cache made for it, below.)"""
    model = make_model("llama")
    with press(model):
        cache = model(prompt(64)).cache
        token = prompt(1, seed=1)
        cache = model(token, cache=cache).cache  # the cache is full: each step from here on evicts
        eager_cache = copy.deepcopy(cache)
        eager = model(token, cache=eager_cache).logits
        torch._dynamo.reset()
        counters.clear()
        try:
            compiled = torch.compile(model, backend="eager")(token, cache=cache).logits
            breaks = dict(counters["graph_break"])
        finally:
            torch._dynamo.reset()
    assert not breaks, f"graph breaks in a {press.label()} step: {list(breaks)}"
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for ours, theirs in zip(cache.compressed_layers(), eager_cache.compressed_layers()):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.positions, theirs.positions)


def boolean_arg_reductions(gm) -> list[str]:
    """The graph's argmax / argmin over booleans or bytes, which inductor compiles wrongly (indices past the end:
    pytorch/pytorch#174069, a device-side assertion on an H200); `buffers.first_true` is the way."""
    found = []
    for node in gm.graph.nodes:
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if name in ("argmax", "argmin") and node.args:
            value = getattr(node.args[0], "meta", {}).get("example_value")
            if isinstance(value, torch.Tensor) and value.dtype in (torch.bool, torch.int8, torch.uint8):
                found.append(f"{name} over {value.dtype}")
    return found


def count_graphs(graphs: list, ints: list | None = None, aliased: list | None = None, addresses: list | None = None):
    """A dynamo backend that runs each graph as traced (no code generation), keeps it in `graphs`, the names of
    its inputs that are not tensors (symbolic ints) in `ints`, the shapes of its tensor inputs over one
    storage in `aliased` and the address of each tensor input's storage in `addresses`; it refuses a graph
    with an argmax or argmin over booleans (`boolean_arg_reductions`)."""
    def backend(gm, example_inputs):
        assert not boolean_arg_reductions(gm), boolean_arg_reductions(gm)
        graphs.append(gm)
        if addresses is not None:
            addresses.extend(t.untyped_storage().data_ptr() for t in example_inputs if isinstance(t, torch.Tensor))
        if ints is not None:
            ints.extend(node.name for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
                        if not isinstance(value, torch.Tensor))
        if aliased is not None:
            storages = {}
            for t in example_inputs:
                if isinstance(t, torch.Tensor):
                    storages.setdefault(t.untyped_storage().data_ptr(), []).append(tuple(t.shape))
            aliased.extend(shapes for shapes in storages.values() if len(shapes) > 1)
        return gm.forward
    return backend


def counting_config(graphs: list | None = None, ints: list | None = None, aliased: list | None = None,
                    addresses: list | None = None) -> CompileConfig:
    """generate's `compile_config` with the `count_graphs` backend, compiling on a CPU too (transformers compiles
    there only when asked to)."""
    config = CompileConfig(backend=count_graphs([] if graphs is None else graphs, ints, aliased, addresses),
                           mode=None)
    config._compile_all_devices = True
    return config


def left_padded(length: int = 64, pad: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 2: a prompt of `length` tokens, and one of `length - pad` left-padded to it."""
    ids = torch.cat([prompt(length), prompt(length, seed=1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


# CHESS on small pages, so that a 64-token prompt has candidates: overlapping pages selected at every step, and
# the paper's pages under a budget, selected every other step (a count on the device).
CHESS = [CHESSPress(ratio=0.25, page_size=4, chunk_pages=2, grid_chunks=2, reselect="always"),
         CHESSPress(read_budget=32, paper=True, page_size=4, chunk_pages=2, grid_chunks=2, reselect_every=2)]
# SentenceKV ranking every layer when a step begins (its default) and each layer at its query (the paper's order).
SENTENCE = [SentencePress(make_tokenizer(), ratio=0.25, n_sinks=4, window_size=4),
            SentencePress(make_tokenizer(), ratio=0.25, n_sinks=4, window_size=4, rank_at="layer")]
COMPILED = [StreamingLLMPress(ratio=0.25, window_size=1), H2OPress(ratio=0.25, recent_ratio=0.25, window_size=1),
            SnapKVPress(ratio=0.25, window_size=8), ChunkPress(ratio=0.25, window_size=8, chunk_size=4), *CHESS,
            KnormPress(ratio=0.25, min_budget=8), KeyDiffPress(ratio=0.25, min_budget=8),
            TOVAPress(ratio=0.25, min_budget=8), *SENTENCE, PyramidKVPress(ratio=0.25, window_size=8),
            AdaKVPress(SnapKVPress(ratio=0.25, window_size=8)), AdaKVPress(TOVAPress(ratio=0.25, min_budget=8)),
            ExpectedAttentionPress(ratio=0.25, min_budget=8), KVzipPress(byte_tokenizer(), ratio=0.25, chunk_size=16,
                                                              min_budget=8)]


@dataclasses.dataclass(kw_only=True)
class EagerPress(SnapKVPress):
    """A press whose decoding steps do not compile (every built-in press's do): a user's, say."""

    compiled_decoding: ClassVar[bool] = False


def label(press) -> str:
    if isinstance(press, AdaKVPress):
        return f"AdaKV-{label(press.press)}"
    return press.label() + ("-paper" if getattr(press, "paper", False) else "") + (
        "-layer" if getattr(press, "rank_at", None) == "layer" else "")


def compiled_cache(model, press, new: int = 8):
    """A compiled cache with room for `new` tokens (used by the presses that keep every generated token)."""
    return press.make_cache(model, compiled=True, max_new_tokens=new)


@pytest.mark.parametrize("batch", ["one", "left-padded"])
@pytest.mark.parametrize("press", COMPILED, ids=label)
@torch.no_grad()
def test_generate_compiles_the_decoding_steps(press, batch):
    """Under a press whose steps compile (`compiled_decoding`), generate given a `compile_config` and a cache
    the press made `compiled` compiles its decoding forward: the eager tokens exactly, greedy, one prompt or a
    left-padded batch, with no graph break. Its graphs are traced at the first step and never again: not at later steps
    (the step reads no Python value that changes, `KVLayer.count_step`), not for a second generation; none takes
    an int (which CUDA graphs would record anew for each value), a prompt of another length included (its sizes
    are constants, `buffers.step_state`), and no two tensor inputs share memory (CUDA graphs skip a graph that
    writes into such inputs). Without a `compile_config`, or on a cache not made `compiled`,
    nothing is compiled."""
    model = make_model("llama")
    ids, mask = (prompt(64), None) if batch == "one" else left_padded()
    graphs, ints, aliased = [], [], []
    config = counting_config(graphs, ints, aliased)
    torch._dynamo.reset()
    counters.clear()
    try:
        with press(model):
            eager = greedy(model, ids, mask, new=8, cache=press.make_cache(model))
            assert torch.equal(greedy(model, ids, mask, new=8, cache=press.make_cache(model), compile_config=config),
                               eager)
            assert not graphs
            one_step = greedy(model, ids, mask, new=2, cache=compiled_cache(model, press), compile_config=config)
            traced = len(graphs)
            compiled = greedy(model, ids, mask, new=8, cache=compiled_cache(model, press), compile_config=config)
            again = len(graphs)
            # A prompt of another length (another budget) gets graphs of its own sizes, not symbolic ones.
            shorter, shorter_mask = (prompt(48), None) if batch == "one" else left_padded(48)
            assert torch.equal(greedy(model, shorter, shorter_mask, new=4, cache=compiled_cache(model, press),
                                      compile_config=config),
                               greedy(model, shorter, shorter_mask, new=4, cache=press.make_cache(model)))
        breaks = dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled, eager) and torch.equal(one_step, eager[:, :ids.shape[1] + 2])
    assert not breaks, f"graph breaks: {list(breaks)}"
    assert traced and again == traced, f"{again - traced} graphs traced after the first step"
    # One graph a step, the model's (its hooks' host work runs eagerly, `hooks._before_model`, `_after_model`),
    # the press's reading of the logits in it (CHESS's trigger, at the output head).
    assert traced == 1, f"{traced} graphs for the first step"
    assert not ints, f"int inputs (symbolic sizes among them): {ints}"
    assert not aliased, f"inputs over one storage: {aliased}"


@pytest.mark.parametrize("press", COMPILED[:3], ids=label)
@torch.no_grad()
def test_a_compiled_step_guards_each_layers_buffers_alone(press):
    """The tensors dynamo guards before every compiled step, of each layer, are its step views' buffers: no view of
    them held as the layer's tensors (they are made in the graph), and no index of its writes (slot n, each row and
    head, made in the graph from the buffers' static sizes) among the graph's inputs."""
    model = make_model("llama")
    inputs, guards = [], []
    config = counting_config(addresses=inputs)
    logger = logging.getLogger("torch._dynamo.guards.__guards")
    handler = logging.Handler()
    handler.emit = lambda record: guards.append(record.getMessage())
    torch._dynamo.reset()
    torch._logging.set_logs(guards=True)
    logger.addHandler(handler)
    try:
        with press(model):
            cache = compiled_cache(model, press)
            greedy(model, prompt(64), None, new=4, cache=cache, compile_config=config)
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()
    indices = {t.untyped_storage().data_ptr() for layer in cache.compressed_layers() for t in layer._views._indices}
    assert inputs and indices and not indices & set(inputs)
    guarded = re.findall(r"check_tensor\(L\['kwargs'\]\['cache'\]\.layers\[(\d+)\](.*?), Tensor,", "\n".join(guards))
    layers = cache.compressed_layers()
    assert guarded and {i for i, _ in guarded} == {str(cache.layers.index(layer)) for layer in layers}
    buffers = {f"._views.grown[{name!r}]" for name in ("keys", "values", "positions", "valid")} | {
        f"._views.grown[('extra', {name!r})]" for name in layers[0].extra}
    assert {source for _, source in guarded} == buffers
    assert len(guarded) == len(buffers) * len(layers)


@pytest.mark.parametrize("press", CHESS, ids=label)
@torch.no_grad()
def test_a_compiled_chess_generation_counts_its_selections_as_an_eager_one(press):
    """CHESS counts the selections its rows take in one place, on the device, eagerly and compiled: a compiled
    generation's `stats()` has its steps' selections (every step's under `reselect="always"`, every other step's
    under `reselect_every=2`), as many as the eager generation's."""
    eager, compiled = counted_generations(press, prompt(64), None)
    expected = 1 + (7 if press.reselect == "always" else 3)  # the prompt's, then the 7 steps' triggers
    assert eager["selections"] == compiled["selections"] == expected


@torch.no_grad()
def test_a_compiled_chess_step_that_selects_in_its_graph_decodes_as_the_eager_one(monkeypatch):
    """Where the host cannot read the device without a wait (a GPU's: `buffers.host_reads_free`), a compiled CHESS
    step runs Algorithm 1 in its graph at every step, taken in the rows whose trigger fires, and gathers its
    working context anew: the eager tokens and selections, on a left-padded batch re-selecting every other step,
    in one graph with no branch."""
    monkeypatch.setattr(chess, "host_reads_free", lambda device: False)
    graphs = []
    eager, compiled, eager_cache, compiled_cache_ = generations(CHESS[1], *left_padded(), graphs=graphs)
    assert torch.equal(compiled, eager)
    assert eager_cache.stats().counts["selections"] == compiled_cache_.stats().counts["selections"]
    assert len(graphs) == 1 and gathers(graphs[0]) == 2 * make_model("llama").config.num_hidden_layers


def gathers(gm) -> int:
    """The graph's gathers from a layer's store (a layer gathering its keys and values makes two)."""
    return sum(1 for node in gm.graph.nodes if getattr(node.target, "__name__", node.target) == "gather"
               and "store" in getattr(node.args[0], "name", ""))


@pytest.mark.parametrize("press", CHESS, ids=label)
@torch.no_grad()
def test_a_compiled_chess_step_on_a_cpu_gathers_nothing(press):
    """On a CPU, a compiled CHESS step's graph gathers nothing from the stores: its token joins its layers'
    working sets in a free slot, and the working context is gathered on the host between steps, when a selection
    or the window changed it (`select_between_steps`): as often as an eager generation rebuilds it before a
    step, the eager tokens."""
    graphs = []
    eager, compiled, eager_cache, compiled_cache_ = generations(press, prompt(64), None, new=12, graphs=graphs)
    assert torch.equal(compiled, eager)
    assert len(graphs) == 1 and gathers(graphs[0]) == 0
    # (an eager generation also rebuilds it after its last step, when that step's trigger fires)
    rebuilds = eager_cache.counts["rebuilds"]
    assert 1 < compiled_cache_.counts["rebuilds"] and rebuilds - 1 <= compiled_cache_.counts["rebuilds"] <= rebuilds


def generations(press, ids: torch.Tensor, mask: torch.Tensor | None, new: int = 8,
                graphs: list | None = None) -> tuple:
    """Greedy generations of `new` tokens under `press`, eager then compiled (its graphs into `graphs`):
    `(eager tokens, compiled tokens, eager cache, compiled cache)`."""
    model = make_model("llama")
    torch._dynamo.reset()
    try:
        with press(model):
            eager_cache, compiled_cache_ = press.make_cache(model), compiled_cache(model, press, new)
            eager = greedy(model, ids, mask, new=new, cache=eager_cache)
            compiled = greedy(model, ids, mask, new=new, cache=compiled_cache_,
                              compile_config=counting_config(graphs))
    finally:
        torch._dynamo.reset()
    return eager, compiled, eager_cache, compiled_cache_


def counted_generations(press, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[dict, dict]:
    """The press's event counts (`stats().counts`) after a greedy generation of 8 tokens, eager and compiled."""
    return tuple(cache.stats().counts for cache in generations(press, ids, mask)[2:])


@pytest.mark.parametrize("press", SENTENCE, ids=label)
@torch.no_grad()
def test_a_compiled_sentencekv_generation_counts_its_loads_as_an_eager_one(press):
    """SentenceKV counts its rankings per row on the device, eagerly and compiled: a compiled generation's
    `stats()` has as many selections, loads and loaded tokens as the eager one's (a compiled step writes its
    whole loaded region, but counts the tokens entering the selection, as an eager step copies them)."""
    counts = [{kind: c[kind] for kind in ("selections", "loads", "loaded_tokens")}
              for c in counted_generations(press, *left_padded())]
    layers = make_model("llama").config.num_hidden_layers  # (every one compressed)
    assert counts[0] == counts[1] and counts[0]["selections"] == 7 * 2 * layers and counts[0]["loaded_tokens"] > 0


@pytest.mark.parametrize("press", SENTENCE, ids=label)
@torch.no_grad()
def test_a_compiled_sentencekv_step_that_loads_in_its_graph_holds_its_loaded_slots_in_order_of_position(
        press, monkeypatch):
    """Where a step finds its loads in its graph (ranking at each layer, or where the host cannot read the device
    without a wait: a GPU's, `buffers.host_reads_free`), it writes each layer's whole loaded region and stores no
    `device_slot`: the region holds the resident store slots in order of position, each at the count of those
    before it, in every layer, row and head, after steps whose selections changed; the eager tokens."""
    monkeypatch.setattr(sentencekv, "host_reads_free", lambda device: False)
    graphs = []
    eager, compiled, _, cache = generations(press, *left_padded(), graphs=graphs)
    assert torch.equal(compiled, eager)
    layers = make_model("llama").config.num_hidden_layers
    assert len(graphs) == 1 and gathers(graphs[0]) == 3 * layers  # keys, values and positions
    assert cache.stats().counts["loaded_tokens"] > 0
    for stack in cache.state.stacks:
        assert stack.device_slot is None
        for layer_idx, rank in stack.ranks.items():
            layer = cache.layers[layer_idx]
            for row, head in itertools.product(*map(range, layer.positions.shape[:2])):
                loaded = layer.store_positions[row][stack.resident[row, rank, head].bool()]
                assert torch.equal(layer.positions[row, head, :len(loaded)], loaded)


@torch.no_grad()
def test_a_compiled_sentencekv_step_on_a_cpu_gathers_nothing():
    """On a CPU, a compiled SentenceKV step ranking every layer when it begins (the default) leaves the ranking
    and the loads to the host, before the step, as an eager step makes them (`begin_forward`): only the tokens
    entering a selection are copied, its graph gathers nothing from the stores, and the tokens are the eager ones."""
    graphs = []
    eager, compiled, eager_cache, cache = generations(SENTENCE[0], *left_padded(), graphs=graphs)
    assert torch.equal(compiled, eager)
    assert len(graphs) == 1 and gathers(graphs[0]) == 0
    assert all(stack.device_slot is not None for stack in cache.state.stacks)
    assert cache.stats().counts["loaded_tokens"] == eager_cache.stats().counts["loaded_tokens"] > 0


@pytest.mark.parametrize("press", [StreamingLLMPress(budget=68, window_size=1),
                                   StreamingLLMPress(ratio=1.0, window_size=1), H2OPress(budget=68, window_size=1),
                                   SnapKVPress(budget=80, window_size=8)], ids=["StreamingLLM", "StreamingLLM-1.0",
                                                                                "H2O", "SnapKV"])
@torch.no_grad()
def test_a_prompt_kept_whole_compiles_once(press):
    """A prompt no longer than the budget is kept whole; its row grows while decoding (to the budget, then rolls
    or evicts; or, keeping everything, for good). A compiled cache holds free slots for that growth from the
    prompt on (`KVLayer.make_step_room`), so the steps are traced once and give the eager tokens, before and
    after the budget is reached."""
    model = make_model("llama")
    graphs = []
    config = counting_config(graphs)
    torch._dynamo.reset()
    try:
        with press(model):
            eager = greedy(model, prompt(64), new=10, cache=press.make_cache(model))
            compiled = greedy(model, prompt(64), new=3, cache=compiled_cache(model, press, 10),
                              compile_config=config)
            traced = len(graphs)
            compiled = greedy(model, prompt(64), new=10, cache=compiled_cache(model, press, 10),
                              compile_config=config)
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled, eager)
    assert traced and len(graphs) == traced, f"{len(graphs) - traced} graphs traced after the first step"


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("press", [SnapKVPress(ratio=0.25, window_size=8), CHESS[0], SENTENCE[0]], ids=label)
@torch.no_grad()
def test_a_compiled_cache_without_room_fails_loudly(press, compile_):
    """A compiled cache under a press that keeps every generated token has room for `max_new_tokens` (free slots,
    or CHESS's store): a step that finds none fails (a device-side check, no host read), eagerly or compiled, and
    overwrites nothing. (On CUDA the check is a device-side assertion, which ends the process's CUDA context: not
    run there.)"""
    if conftest.DEVICE.type != "cpu":
        pytest.skip("a device-side assertion ends the CUDA context")
    model = make_model("llama")
    config = counting_config()
    torch._dynamo.reset()
    try:
        with press(model):
            assert greedy(model, prompt(64), new=5, cache=compiled_cache(model, press, 4),
                          compile_config=config if compile_ else None).shape[1] == 64 + 5
            with pytest.raises(RuntimeError, match="no (free slot|room) left.*max_new_tokens"):
                greedy(model, prompt(64), new=6, cache=compiled_cache(model, press, 4),
                       compile_config=config if compile_ else None)
    finally:
        torch._dynamo.reset()


def held(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions and keys of a layer's real tokens, per row and head in order of position (a compiled cache
    holds free slots besides them, `KVLayer.make_step_room`)."""
    order = layer.positions.masked_fill(~layer.valid, -1).argsort(dim=-1, stable=True)
    real = int(layer.valid.sum(-1).min())
    order = order[..., -real:]
    return layer.positions.gather(-1, order), layer.keys.gather(2, order[..., None].expand(-1, -1, -1,
                                                                                          layer.keys.shape[-1]))


@pytest.mark.parametrize("press", COMPILED, ids=label)
@torch.no_grad()
def test_a_compiled_generation_leaves_the_eager_cache(press):
    """Compiled steps count their tokens on the device (`KVLayer.count_step`) until the next eager forward
    settles the count: the cache a compiled generation leaves reports the eager one's length, holds the same
    tokens at the same positions, and an eager forward from it gives the eager cache's logits. (To float32's
    rounding: where a compiled cache holds free slots, attention sums over them masked, in another order.)"""
    model = make_model("llama")
    config = counting_config()
    torch._dynamo.reset()
    try:
        with press(model):
            eager_cache, cache = press.make_cache(model), compiled_cache(model, press)
            eager = greedy(model, prompt(64), new=6, cache=eager_cache, suppress_tokens=[2])  # (no early end)
            compiled = greedy(model, prompt(64), new=6, cache=cache, compile_config=config, suppress_tokens=[2])
            assert torch.equal(compiled, eager)
            assert cache.get_seq_length() == eager_cache.get_seq_length() == 64 + 5
            for ours, theirs in zip(cache.compressed_layers(), eager_cache.compressed_layers()):
                if isinstance(ours, StoreLayer):  # (CHESS: every token in the store, at its position)
                    end = ours.logical_len
                    torch.testing.assert_close(ours.store_keys[:, :, :end], theirs.store_keys[:, :, :end], rtol=0,
                                               atol=1e-5)
                    continue
                (positions, keys), (eager_positions, eager_keys) = held(ours), held(theirs)
                assert torch.equal(positions, eager_positions)
                torch.testing.assert_close(keys, eager_keys, rtol=0, atol=1e-5)
            token = eager[:, -1:]
            after, after_eager = model(token, cache=cache), model(token, cache=eager_cache)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(after.logits, after_eager.logits, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == eager_cache.get_seq_length() == 64 + 6


@pytest.mark.parametrize("press", COMPILED, ids=label)
@torch.no_grad()
def test_a_step_builds_one_mask_and_finds_one_slot_per_layout(press, monkeypatch):
    """A compiled cache's layers that hold one validity after the prompt share a layout (`SparseCache.layouts`;
    every layer, under most presses): a decoding step builds the mask at the first layer of each layout, and a
    press that keeps every token finds its token's free slot there, for the others; the step's logits and every
    layer's tokens are those of a step that builds and finds them per layer."""
    import sparsekv.cache
    import sparsekv.layers

    model = make_model("llama")
    ids, mask = left_padded()
    step = prompt(1, batch=2, seed=3)
    with press(model):
        cache = compiled_cache(model, press)
        model(ids, attention_mask=mask, cache=cache)
        layouts = set(cache.layouts.values())
        assert sorted(cache.layouts) == [i for i, layer in enumerate(cache.layers) if isinstance(layer, KVLayer)]
        assert cache.one_layout == (len(layouts) == 1)
        if isinstance(press, PyramidKVPress):  # a budget per layer: a layout per layer
            assert len(layouts) == len(cache.layouts)
        elif not isinstance(press, (ChunkPress, AdaKVPress, KVzipPress)):  # (ChunkKV: a layout per count of tokens
            assert cache.one_layout  # its chunks hold; AdaKV, KVzip: per split of a budget between heads)
        for i, leader in cache.layouts.items():
            assert torch.equal(cache.layers[i].valid, cache.layers[leader].valid)
        twin = copy.deepcopy(cache)
        twin.layouts = {}
        expected = model(step, cache=twin).logits
        calls = {"mask": 0, "slot": 0}

        def counted(name, fn):
            def run(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return run
        monkeypatch.setattr(sparsekv.cache, "physical_mask", counted("mask", sparsekv.cache.physical_mask))
        monkeypatch.setattr(sparsekv.layers, "first_true", counted("slot", sparsekv.layers.first_true))
        logits = model(step, cache=cache).logits
    assert calls["mask"] == len(layouts)
    if not press.holds_budget_while_decoding():  # (an evicting press's victims are its scores' in each layer)
        assert calls["slot"] == len(layouts)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    for ours, theirs in zip(cache.compressed_layers(), twin.compressed_layers()):
        assert torch.equal(ours.positions, theirs.positions) and torch.equal(ours.valid, theirs.valid)


def test_chunkkv_layers_of_other_chunk_totals_hold_layouts_of_their_own():
    """ChunkKV keeps whole chunks, so layers whose chunks hold fewer tokens than the budget hold another validity
    than the others: each such set of layers is a layout of its own (`SparseCache.layouts`), its mask built once a
    step, and the compiled step's logits are the eager step's."""
    model = make_model("llama")
    ids, mask = left_padded()
    press = ChunkPress(ratio=0.4, window_size=2, chunk_size=5, reuse_layers=1)
    with torch.no_grad(), press(model):
        cache = compiled_cache(model, press)
        model(ids, attention_mask=mask, cache=cache)
        # (keep puts a row's fillers first: layers whose rows keep as many tokens hold one validity)
        kept = {i: tuple(cache.layers[i].valid.sum(-1).flatten().tolist()) for i in cache.layouts}
        assert len(set(kept.values())) > 1  # (else this checks nothing: choose another prompt)
        for i, leader in cache.layouts.items():
            assert (leader == i) == all(kept[j] != kept[i] for j in cache.layouts if j < i)
        twin = copy.deepcopy(cache)
        twin.layouts = {}
        step = prompt(1, batch=2, seed=3)
        torch.testing.assert_close(model(step, cache=cache).logits, model(step, cache=twin).logits, rtol=0, atol=0)


def test_a_cache_that_cannot_compile_is_refused_at_the_door():
    """`compiled=True` under a press whose steps do not compile, or on a model with layers the press does not
    compress (which keep transformers' growing cache), is refused when the cache is made, naming what to do."""
    with pytest.raises(ValueError, match="max_new_tokens: CHESSPress keeps every generated token"):
        CHESSPress(ratio=0.25).make_cache(make_model("llama"), compiled=True)
    with pytest.raises(ValueError, match="EagerPress's decoding steps do not compile yet"):
        EagerPress(ratio=0.25).make_cache(make_model("llama"), compiled=True, max_new_tokens=8)
    with pytest.raises(ValueError, match="max_new_tokens: SnapKVPress keeps every generated token.*max_new_tokens="):
        SnapKVPress(ratio=0.25).make_cache(make_model("llama"), compiled=True)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        SnapKVPress(ratio=0.25).make_cache(make_model("llama"), compiled=True, max_new_tokens=0)
    with pytest.raises(ValueError, match="mixes in layers StreamingLLMPress does not compress"):
        StreamingLLMPress(ratio=0.25, window_size=1).make_cache(make_model("gemma3"), compiled=True)
    assert not StreamingLLMPress(ratio=0.25, window_size=1).make_cache(make_model("llama")).is_compileable



def test_the_presses_named_as_compiling_are_those_that_declare_it():
    """The refusal of a compiled cache and the eager notice name the presses whose steps compile from one line
    written by hand (`generation.COMPILING`: the core cannot import the presses): exactly the built-in presses
    that declare `compiled_decoding`, so that a press that gains or loses it is named right."""
    from sparsekv.generation import COMPILING
    from sparsekv.presses.registry import BUILT_IN

    named = set(re.findall(r"(\w+)'s", COMPILING))
    assert named == {cls.label() for cls in BUILT_IN.values() if cls.compiled_decoding}

@pytest.mark.parametrize("press", [EagerPress(budget=16, window_size=4), SnapKVPress(budget=16, window_size=4)],
                         ids=["uncompiled", "SnapKV"])
@torch.no_grad()
def test_a_compile_config_that_cannot_be_served_is_said_once(press, caplog):
    """generate given a `compile_config` over a cache it cannot compile (a press whose steps do not compile, or
    a cache not made `compiled`) decodes eagerly, the eager tokens, and the `sparsekv` logger says why, once a
    block."""
    model = make_model("llama")
    ids = prompt(64)
    config = counting_config()
    with press(model):
        eager = greedy(model, ids, None, new=4)
        with caplog.at_level(logging.WARNING, logger="sparsekv"):
            for _ in range(2):
                assert torch.equal(greedy(model, ids, None, new=4, compile_config=config), eager)
    said = [r.getMessage() for r in caplog.records if r.name == "sparsekv" and "decodes eagerly" in r.getMessage()]
    assert len(said) == 1, said
    assert ("do not compile yet" if isinstance(press, EagerPress) else "SnapKVPress(..., compile=True)") in said[0]


@pytest.mark.parametrize("press", [SnapKVPress(ratio=0.25, window_size=8), H2OPress(ratio=0.25, window_size=1),
                                   CHESS[0]], ids=label)
@torch.no_grad()
def test_the_compile_option_compiles_generate_called_as_without_it(press):
    """`compile=True`: generate called with no cache compiles its decoding steps (here with the test's backend, a
    `compile_config` given; without one the block's default compiles, on a CPU too), over a compiled cache sized
    by the generation's `max_new_tokens`: the eager tokens, compiled, and the model's generation config as it
    was once the block ends."""
    model = make_model("llama")
    ids, mask = left_padded()
    with press(model):
        eager = greedy(model, ids, mask, new=8)
    config = model.generation_config
    before = config.cache_implementation, config.compile_config
    graphs = []
    torch._dynamo.reset()
    try:
        with dataclasses.replace(press, compile=True)(model):
            assert config.cache_implementation == "static" and config.compile_config._compile_all_devices
            out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                 compile_config=counting_config(graphs), return_dict_in_generate=True)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out.sequences, eager) and out.cache.compiled and graphs
    assert (config.cache_implementation, config.compile_config) == before


def test_the_compile_option_compiles_with_the_models_config_and_sparsekvs_inductor_options():
    """`compile=True` compiles with the model's own `compile_config` (transformers' default where it has none),
    its mode given as the options it stands for, with inductor's `reorder_for_locality` off
    (`sparsekv.compile_config`: on, it makes inductor copy each layer's values whole at every evicting step); the
    model's config is as it was once the block ends. Options of one's own win; another backend is left as it is."""
    model = make_model("llama")
    config = model.generation_config
    own = CompileConfig(dynamic=False, mode="max-autotune-no-cudagraphs")
    config.compile_config = own
    try:
        with SnapKVPress(ratio=0.25, compile=True)(model):
            inner = config.compile_config
            assert inner.dynamic is False and inner.mode is None and inner.options == {
                **torch._inductor.list_mode_options("max-autotune-no-cudagraphs"), "reorder_for_locality": False}
        assert config.compile_config is own
    finally:
        config.compile_config = None
    assert own.mode == "max-autotune-no-cudagraphs" and own.options is None
    default = compile_config()
    assert default._compile_all_devices and default.mode is None
    assert default.options == {"triton.cudagraphs": True, "reorder_for_locality": False}
    mine = compile_config(CompileConfig(mode=None, options={"reorder_for_locality": True}))
    assert mine.options == {"reorder_for_locality": True} and not mine._compile_all_devices
    assert compile_config(CompileConfig(backend="eager")) == CompileConfig(backend="eager")


def test_the_compile_option_is_refused_where_steps_cannot_compile():
    """`compile=True` under a press whose steps do not compile is refused when the press is made; on a model with
    layers the press does not compress, when the block begins."""
    with pytest.raises(ValueError, match="EagerPress: compile=True, but EagerPress's decoding steps do not"):
        EagerPress(ratio=0.25, compile=True)
    model = make_model("gemma3")
    with pytest.raises(ValueError, match="mixes in layers StreamingLLMPress does not compress"):
        with StreamingLLMPress(ratio=0.25, window_size=1, compile=True)(model):
            pass
    assert model.generation_config.cache_implementation is None


@torch.no_grad()
def test_a_compiled_batch_is_not_continued_with_unreadable_padding():
    """A compiled cache's forwards get 4D masks from generate, in which a continued prompt's padding cannot be
    read: a batch continued with several tokens a row is refused, not read as unpadded. A cache not made compiled
    is continued as before."""
    model, press = make_model("llama"), StreamingLLMPress(ratio=0.25, window_size=1)
    ids, mask = left_padded()
    with press(model):
        for compiled in (True, False):
            cache = press.make_cache(model, compiled=compiled)
            out = greedy(model, ids, mask, new=2, cache=cache)
            more = torch.cat([out, prompt(4, batch=2, seed=2)], dim=1)
            more_mask = torch.cat([mask, mask.new_ones(2, more.shape[1] - mask.shape[1])], dim=1)
            if compiled:
                with pytest.raises(ValueError, match="cannot be continued with several tokens a row"):
                    greedy(model, more, more_mask, new=1, cache=cache)
            else:
                assert greedy(model, more, more_mask, new=1, cache=cache).shape == (2, more.shape[1] + 1)
                assert model(prompt(4, batch=2, seed=3), cache=cache).logits.shape[:2] == (2, 4)  # (no mask)


def test_first_true_finds_the_first_free_slot():
    """`first_true`: the first True of each row (a free slot), the row's size where there is none."""
    from sparsekv.buffers import first_true
    mask = torch.tensor([[False, False, True, True], [True, False, False, False], [False] * 4])
    assert first_true(mask).tolist() == [2, 0, 4]


@pytest.mark.parametrize("mode", ["beam", "prompt-lookup", "sample"])
@pytest.mark.parametrize("press", [SnapKVPress(ratio=0.25, window_size=8), H2OPress(ratio=0.25, window_size=1),
                                   CHESS[0], SENTENCE[0]], ids=label)
@torch.no_grad()
def test_other_generate_modes_on_a_compiled_cache(press, mode):
    """A compiled cache under beam search (generate decodes it eagerly, reordering its rows), prompt lookup (it
    compiles the draft verifications, several tokens a forward, then crops) and sampling gives the tokens of a
    cache not made compiled. CHESS's compiled cache decodes one token a step: a draft is refused, naming what
    to do."""
    if isinstance(press, CHESSPress) and mode == "prompt-lookup":
        model = make_model("llama")
        with press(model), pytest.raises(ValueError, match="decodes one token a step.*without compiled=True"):
            model.generate(prompt(64), max_new_tokens=8, pad_token_id=0, prompt_lookup_num_tokens=3,
                           cache=compiled_cache(model, press))
        return
    model = make_model("llama")
    options = {"beam": {"num_beams": 3}, "prompt-lookup": {"prompt_lookup_num_tokens": 3},
               "sample": {"do_sample": True, "top_k": 5}}[mode]
    config = counting_config()
    torch._dynamo.reset()
    outs = []
    try:
        with press(model):
            for cache, compile_config in ((press.make_cache(model), None), (compiled_cache(model, press), config)):
                torch.manual_seed(0)
                outs.append(model.generate(prompt(64), max_new_tokens=8, min_new_tokens=8, pad_token_id=0,
                                           cache=cache, compile_config=compile_config, **options))
    finally:
        torch._dynamo.reset()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("press", CHESS, ids=label)
@torch.no_grad()
def test_a_compiled_chess_cache_continued_with_a_question(press):
    """A compiled CHESS cache continued with more tokens (a question asked of a compressed context, generate's
    prompt read in pieces) reads every token, selects again, and plans its steps anew for the tokens still to
    come: the tokens of a cache not made compiled, compiled or not."""
    model = make_model("llama")
    config = counting_config()
    torch._dynamo.reset()
    outs = []
    try:
        with press(model):
            for cache, compile_config in ((press.make_cache(model), None), (compiled_cache(model, press), None),
                                          (compiled_cache(model, press), config)):
                first = greedy(model, prompt(64), new=4, cache=cache, compile_config=compile_config)
                more = torch.cat([first, prompt(8, seed=3)], dim=1)
                outs.append(greedy(model, more, new=6, cache=cache, compile_config=compile_config))
    finally:
        torch._dynamo.reset()
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
