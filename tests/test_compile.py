"""A decoding step under a press as `torch.compile` traces it (what generate's `compile_config` compiles): the
model's forward with the press's hooks and work inside it."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_model, prompt
from torch._dynamo.utils import counters

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
