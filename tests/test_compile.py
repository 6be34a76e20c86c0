"""A decoding step under a press as `torch.compile` traces it (what generate's `compile_config` compiles): the
model's forward with the press's hooks and work inside it."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_model, prompt
from torch._dynamo.utils import counters

from sparsekv import H2OPress, StreamingLLMPress


@pytest.mark.parametrize("press", [StreamingLLMPress(ratio=0.25), H2OPress(ratio=0.25)], ids=lambda p: p.label())
@torch.no_grad()
def test_an_evicting_presss_decoding_step_traces_without_a_graph_break(press):
    """dynamo traces a decoding step on a full cache, the hooks and the press's eviction included, without a graph
    break (the driver takes no clock while compiling; nothing it builds is a class dynamo cannot construct); the
    step gives the eager step's logits and leaves the same cache."""
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
