"""A decoding step under a press as `torch.compile` traces it (what generate's `compile_config` compiles): the
model's forward with the press's hooks and work inside it."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import greedy, make_model, prompt
from torch._dynamo.utils import counters
from transformers import CompileConfig

from sparsekv import ChunkPress, H2OPress, SnapKVPress, StreamingLLMPress

PRESSES = [StreamingLLMPress(ratio=0.25), H2OPress(ratio=0.25), SnapKVPress(ratio=0.25, window_size=8),
           ChunkPress(ratio=0.25, window_size=8, chunk_size=4)]


@pytest.mark.parametrize("press", PRESSES, ids=lambda p: p.label())
@torch.no_grad()
def test_a_decoding_step_traces_without_a_graph_break(press):
    """dynamo traces a decoding step, the hooks and the press's work included (an eviction on a full cache, or the
    token appended to a compressed prompt), without a graph break: the driver takes no clock while compiling,
    makes nothing dynamo cannot construct, and a layer appends by concatenation (the room behind a tensor is read
    from its storage, which dynamo cannot follow). The step gives the eager step's logits and leaves the same
    cache. (CHESS breaks at its trigger's host read after the logits, SentenceKV at its loads' `nonzero`.)"""
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


def count_graphs(graphs: list, ints: list | None = None, aliased: list | None = None):
    """A dynamo backend that runs each graph as traced (no code generation), keeps it in `graphs`, the names of
    its inputs that are not tensors (symbolic ints) in `ints` and the shapes of its tensor inputs over one
    storage in `aliased`."""
    def backend(gm, example_inputs):
        graphs.append(gm)
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


def left_padded(length: int = 64, pad: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 2: a prompt of `length` tokens, and one of `length - pad` left-padded to it."""
    ids = torch.cat([prompt(length), prompt(length, seed=1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


COMPILED = [StreamingLLMPress(ratio=0.25), H2OPress(ratio=0.25, recent_ratio=0.25)]


@pytest.mark.parametrize("batch", ["one", "left-padded"])
@pytest.mark.parametrize("press", COMPILED, ids=lambda p: p.label())
@torch.no_grad()
def test_generate_compiles_the_decoding_steps(press, batch):
    """Under a press whose steps compile (`compiled_decoding`), generate given a `compile_config` and a cache
    the press made `compiled` compiles its decoding forward: the eager tokens exactly, greedy, one prompt or a left-padded
    batch, with no graph break. Its graphs are traced at the first step and never again: not at later steps
    (the step reads no Python value that changes, `KVLayer.count_step`), not for a second generation; none takes
    an int (which CUDA graphs would record anew for each value), and no two tensor inputs share memory (CUDA graphs
    skip a graph that writes into such inputs). Without a `compile_config`, or on a cache not made `compiled`,
    nothing is compiled."""
    model = make_model("llama")
    ids, mask = (prompt(64), None) if batch == "one" else left_padded()
    graphs, ints, aliased = [], [], []
    config = CompileConfig(backend=count_graphs(graphs, ints, aliased), mode=None)
    config._compile_all_devices = True  # (transformers compiles on CPU only when asked to)
    torch._dynamo.reset()
    counters.clear()
    try:
        with press(model):
            eager = greedy(model, ids, mask, new=8, cache=press.make_cache(model))
            assert torch.equal(greedy(model, ids, mask, new=8, cache=press.make_cache(model), compile_config=config),
                               eager)
            assert not graphs
            one_step = greedy(model, ids, mask, new=2, cache=press.make_cache(model, compiled=True),
                              compile_config=config)
            traced = len(graphs)
            compiled = greedy(model, ids, mask, new=8, cache=press.make_cache(model, compiled=True),
                              compile_config=config)
        breaks = dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled, eager) and torch.equal(one_step, eager[:, :-6])
    assert not breaks, f"graph breaks: {list(breaks)}"
    assert traced and len(graphs) == traced, f"{len(graphs) - traced} graphs traced after the first step"
    assert not ints, f"int inputs: {ints}"
    assert not aliased, f"inputs over one storage: {aliased}"


@torch.no_grad()
def test_a_growing_cache_compiles_correctly():
    """A prompt shorter than the budget is kept whole and its layers grow until the budget, one slot a step: the
    compiled steps (traced again for the new shapes) give the eager tokens, before and after the budget is
    reached."""
    model, press = make_model("llama"), StreamingLLMPress(budget=68)
    config = CompileConfig(backend=count_graphs([]), mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    try:
        with press(model):
            eager = greedy(model, prompt(64), new=10, cache=press.make_cache(model))
            compiled = greedy(model, prompt(64), new=10, cache=press.make_cache(model, compiled=True),
                              compile_config=config)
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("press", COMPILED, ids=lambda p: p.label())
@torch.no_grad()
def test_a_compiled_generation_leaves_the_eager_cache(press):
    """Compiled steps count their tokens on the device (`KVLayer.count_step`) until the next eager forward
    settles the count: the cache a compiled generation leaves reports the eager one's length, holds the same
    slots, and an eager forward from it gives the same logits as from the eager cache."""
    model = make_model("llama")
    config = CompileConfig(backend=count_graphs([]), mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    try:
        with press(model):
            eager_cache, cache = press.make_cache(model), press.make_cache(model, compiled=True)
            eager = greedy(model, prompt(64), new=6, cache=eager_cache)
            compiled = greedy(model, prompt(64), new=6, cache=cache, compile_config=config)
            assert torch.equal(compiled, eager)
            assert cache.get_seq_length() == eager_cache.get_seq_length() == 64 + 5
            for ours, theirs in zip(cache.compressed_layers(), eager_cache.compressed_layers()):
                assert torch.equal(ours.positions, theirs.positions) and torch.equal(ours.keys, theirs.keys)
            token = eager[:, -1:]
            after, after_eager = model(token, cache=cache), model(token, cache=eager_cache)
    finally:
        torch._dynamo.reset()
    assert torch.equal(after.logits, after_eager.logits)
    assert cache.get_seq_length() == eager_cache.get_seq_length() == 64 + 6


def test_a_cache_that_cannot_compile_is_refused_at_the_door():
    """`compiled=True` under a press whose steps do not compile, or on a model with layers the press does not
    compress (which keep transformers' growing cache), is refused when the cache is made, naming what to do."""
    with pytest.raises(ValueError, match="SnapKVPress's decoding steps do not compile yet.*without compiled=True"):
        SnapKVPress(ratio=0.25).make_cache(make_model("llama"), compiled=True)
    with pytest.raises(ValueError, match="mixes in layers StreamingLLMPress does not compress"):
        StreamingLLMPress(ratio=0.25).make_cache(make_model("gemma3"), compiled=True)
    assert not StreamingLLMPress(ratio=0.25).make_cache(make_model("llama")).is_compileable


@torch.no_grad()
def test_a_compiled_batch_is_not_continued_with_unreadable_padding():
    """A compiled cache's forwards get 4D masks from generate, in which a continued prompt's padding cannot be
    read: a batch continued with several tokens a row is refused, not read as unpadded. A cache not made compiled
    is continued as before."""
    model, press = make_model("llama"), StreamingLLMPress(ratio=0.25)
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
