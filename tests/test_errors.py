"""Bad input gets a ValueError naming the parameter and the allowed values; nothing stays installed."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from test_core import hook_count

from sparsekv import H2OPress, SnapKVPress, StreamingLLMPress

ALL = (SnapKVPress, H2OPress, StreamingLLMPress)


@pytest.mark.parametrize("press_cls", ALL)
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of ratio"),
        ({"ratio": 0.5, "budget": 10}, "exactly one of ratio"),
        ({"ratio": 0.0}, r"ratio must be in \(0, 1\]"),
        ({"ratio": 1.5}, r"ratio must be in \(0, 1\]"),
        ({"ratio": -0.1}, r"ratio must be in \(0, 1\]"),
        ({"ratio": "half"}, r"ratio must be in \(0, 1\]"),
        ({"budget": 0}, "budget must be an integer >= 1"),
        ({"budget": 12.5}, "budget must be an integer >= 1"),
    ],
)
def test_invalid_ratio_or_budget(press_cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        press_cls(**kwargs)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SnapKVPress(ratio=0.5, window_size=0), "window_size must be an integer >= 1"),
        (lambda: SnapKVPress(ratio=0.5, kernel_size=4), "kernel_size must be an odd integer"),
        (lambda: SnapKVPress(ratio=0.5, pooling="mean"), "pooling must be 'max' or 'avg'"),
        (lambda: SnapKVPress(budget=16, window_size=32), "must be at least window_size=32"),
        (lambda: H2OPress(ratio=0.5, recent_ratio=1.2), r"recent_ratio must be in \[0, 1\]"),
        (lambda: StreamingLLMPress(budget=4, n_sinks=4), r"budget=4 must be at least n_sinks=4 \+ window_size=60 = 64"),
        (lambda: H2OPress(budget=16), "budget=16 must be at least window_size=64"),
        (lambda: StreamingLLMPress(ratio=0.5, n_sinks=-1), "n_sinks must be an integer >= 0"),
    ],
)
def test_invalid_press_parameters(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_model_without_attention_modules():
    with pytest.raises(ValueError, match="sparsekv cannot serve Linear: it has no attention layers with a KV cache"):
        with SnapKVPress(ratio=0.5)(torch.nn.Linear(4, 4)):
            pass


def test_nesting_two_presses():
    model = make_model("llama")
    hooks = hook_count(model)
    with SnapKVPress(ratio=0.5)(model):
        with pytest.raises(ValueError, match="already installed on this model; presses do not nest"):
            with H2OPress(ratio=0.5, window_size=1)(model):
                pass
        inner = hook_count(model)
    assert inner > hooks and hook_count(model) == hooks


def test_unsupported_attention_implementation():
    model = make_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation: 'flex_attention' is not supported"):
        with SnapKVPress(ratio=0.5)(model):
            pass
    assert hook_count(model) == 0


def test_model_with_only_sliding_layers():
    model = make_model("mistral", sliding_window=16)
    with pytest.raises(ValueError, match="sparsekv cannot serve MistralForCausalLM: it has no full-attention layers to "
                                         "compress"):
        with SnapKVPress(ratio=0.5)(model):
            pass
