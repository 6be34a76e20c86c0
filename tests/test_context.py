"""The context a press is handed: what `ctx.attention` computes is the attention the model ran."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from conftest import make_model, prompt

from sparsekv import SnapKVPress


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
