"""The context a press is handed: what `ctx.attention` computes is the attention the model ran."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch
from conftest import make_model, prompt

from sparsekv import H2OPress, SnapKVPress


@dataclass(kw_only=True)
class Recorder(SnapKVPress):
    """SnapKV, recording each layer's `ctx.attention()` of the prompt's last queries and of every later forward."""

    seen: dict = field(default_factory=dict, compare=False, repr=False)

    def compress(self, ctx):
        self.seen[("prompt", ctx.layer_idx)] = ctx.attention(-3)
        super().compress(ctx)

    def after_step(self, ctx):
        self.seen[("step", ctx.layer_idx)] = (ctx.attention(), ctx.attention(-1))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("new", [1, 3], ids=["step", "three-tokens"])
@torch.no_grad()
def test_ctx_attention_is_the_attention_the_model_ran(new, padded):
    """`ctx.attention` at the prompt (its last queries over its keys, causal, padding masked) and after it (a
    step's query, or a forward of three tokens, each seeing the slots held and the new tokens up to its own) equals
    the eager attention's own weights, over the slots the compressed layer holds; `attention(-1)` is its last
    query's row."""
    model = make_model("llama", "eager")
    ids = prompt(48, batch=2)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0
    press = Recorder(ratio=0.5, window_size=8)
    with press(model):
        out = model(ids, attention_mask=mask, output_attentions=True)
        for i, weights in enumerate(out.attentions):
            b, h, q, k = weights.shape
            rebuilt = press.seen[("prompt", i)].reshape(b, h, 3, -1)  # the prompt's last 3 queries
            torch.testing.assert_close(rebuilt, weights[:, :, -3:, :rebuilt.shape[-1]].float())
        cache = out.cache
        more = prompt(new, batch=2, seed=1)
        mask = torch.cat([mask, torch.ones_like(more)], dim=1)
        out = model(more, cache=cache, attention_mask=mask, output_attentions=True)
    for i, weights in enumerate(out.attentions):
        every, last = press.seen[("step", i)]
        b, h, q, k = weights.shape
        torch.testing.assert_close(every.reshape(b, h, q, k), weights.float())
        torch.testing.assert_close(last.reshape(b, h, 1, k), weights[:, :, -1:].float())


@dataclass(kw_only=True)
class StepReader(Recorder):
    """The recorder, reading the weights its steps' attention computed (`reads_step_attention`), beside the
    attention computed again from the step's queries (the path flash attention takes)."""

    reads_step_attention: ClassVar[bool] = True

    def after_step(self, ctx):
        kept = ctx.call.weights
        read = ctx.attention(), ctx.attention(-1)
        ctx.call.weights = None
        self.seen[("step", ctx.layer_idx)] = (kept is not None, read, (ctx.attention(), ctx.attention(-1)))


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("new", [1, 3], ids=["step", "three-tokens"])
@torch.no_grad()
def test_a_press_that_reads_a_steps_attention_reads_the_weights_its_attention_computed(implementation, new):
    """Under a press that reads a step's attention, the model's attention keeps its weights at the forwards
    after the prompt (sdpa and eager, wrapped for every press's `with` block and given back after it): `ctx.attention`
    reads them, and they equal the attention computed again from the step's queries; the logits equal those of a
    press that computes it again, in a left-padded batch."""
    model = make_model("llama", implementation)
    ids, more = prompt(48, batch=2), prompt(new, batch=2, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    reader, recorder = StepReader(ratio=0.5, window_size=8), Recorder(ratio=0.5, window_size=8)
    logits = []
    for press in (reader, recorder):
        with press(model):
            inside = model.config._attn_implementation
            cache = model(ids, attention_mask=mask).cache
            logits.append(model(more, cache=cache, attention_mask=torch.cat(
                [mask, torch.ones_like(more)], dim=1)).logits)
        assert model.config._attn_implementation == implementation
        assert inside == f"sparsekv_{implementation}"
    for i in range(model.config.num_hidden_layers):
        kept, read, again = reader.seen[("step", i)]
        assert kept
        torch.testing.assert_close(read, again)
        torch.testing.assert_close(read[0], recorder.seen[("step", i)][0])
    torch.testing.assert_close(logits[0], logits[1])


def test_the_models_attention_is_given_back_when_a_block_fails():
    """The attention implementation a press wraps for its block is the model's own again after the block ends
    with an error."""
    model = make_model("llama", "sdpa")
    with pytest.raises(RuntimeError, match="inside"):
        with H2OPress(ratio=0.5)(model):
            assert model.config._attn_implementation == "sparsekv_sdpa"
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"
