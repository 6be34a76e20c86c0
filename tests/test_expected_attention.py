"""Expected Attention: the queries' statistics turned to the positions to come, and the scores they give."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import greedy, make_model, prompt
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from sparsekv import ExpectedAttentionPress
from sparsekv.attention import rotate
from sparsekv.layers import KVLayer


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_the_statistics_turn_by_the_mean_rotation_of_the_positions_to_come(rope_scaling):
    """The mean rotation from the layer's own table (its last two positions) equals the mean of the rotations the
    model's rotary embedding gives the next `n_future_positions` positions, one by one."""
    model = make_model("llama", **({"rope_scaling": rope_scaling} if rope_scaling else {}))
    rotary = LlamaRotaryEmbedding(model.config)
    d, n, future = model.config.head_dim, 40, 300
    x = torch.zeros(1, n)
    table = rotary(x, torch.arange(n)[None])
    g = torch.Generator().manual_seed(0)
    mean, a = torch.randn(1, 2, d, generator=g), torch.randn(1, 2, d, d, generator=g)
    cov = a @ a.transpose(-1, -2)
    press = ExpectedAttentionPress(ratio=0.5, n_future_positions=future)
    got_mean, got_cov = press.to_future(mean, cov, table)
    cos, sin = rotary(x, torch.arange(n, n + future)[None])
    eye = torch.eye(d).expand(1, 2, d, d)
    rotations = [rotate(eye, (cos[:, p:p + 1], sin[:, p:p + 1])).transpose(-1, -2) for p in range(future)]
    r = torch.stack(rotations).mean(0)  # (1, 2, d, d): the mean rotation, applied as r @ x
    torch.testing.assert_close(got_mean, (r @ mean[..., None])[..., 0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_cov, r @ cov @ r.transpose(-1, -2), rtol=1e-4, atol=1e-3)


def reference_scores(model, layer_idx: int, ids: torch.Tensor, press: ExpectedAttentionPress) -> torch.Tensor:
    """The paper's scores written out for one unpadded row: queries and keys from the layer's own projections."""
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        hidden = model.model.layers[layer_idx].input_layernorm(out.hidden_states[layer_idx])
        attn = model.model.layers[layer_idx].self_attn
        n, d = ids.shape[1], attn.head_dim
        q = attn.q_proj(hidden).view(1, n, -1, d).transpose(1, 2)[0]  # (heads, n, d), before RoPE
        k = attn.k_proj(hidden).view(1, n, -1, d).transpose(1, 2)
        v = attn.v_proj(hidden).view(1, n, -1, d).transpose(1, 2)[0]
        rotary = LlamaRotaryEmbedding(model.config)
        k = rotate(k, rotary(hidden, torch.arange(n)[None]))[0]  # (kv_heads, n, d)
        stats = q[:, press.n_sink:]
        mu = stats.mean(1)
        cov = torch.einsum("hni,hnj->hij", stats - mu[:, None], stats - mu[:, None]) / stats.shape[1]
        cos, sin = rotary(hidden, torch.arange(n, n + press.n_future_positions)[None])
        eye = torch.eye(d).expand(q.shape[0], d, d)[None]
        r = torch.stack([rotate(eye, (cos[:, p:p + 1], sin[:, p:p + 1]))[0].transpose(-1, -2)
                         for p in range(press.n_future_positions)]).mean(0)
        mu, cov = (r @ mu[..., None])[..., 0], r @ cov @ r.transpose(-1, -2)
        group = q.shape[0] // k.shape[0]
        kk = k.repeat_interleave(group, 0)
        logits = (kk @ mu[..., None])[..., 0] / math.sqrt(d) + torch.einsum("hni,hij,hnj->hn", kk, cov, kk) / (2 * d)
        scores = logits.softmax(-1).view(k.shape[0], group, n).mean(1) * v.norm(dim=-1)
        scores[:, :press.n_sink] = float("inf")
        return scores


@torch.no_grad()
def test_the_scores_are_the_papers_expected_attention_times_the_value_norms():
    model = make_model("llama")
    ids = prompt(48)
    press = ExpectedAttentionPress(budget=16, min_budget=8, n_future_positions=64)
    with press(model):
        cache = model(ids, use_cache=True).cache
    for i, layer in enumerate(cache.layers):
        expected = reference_scores(model, i, ids, press)
        kept = expected.topk(16, dim=-1).indices.sort(-1).values
        assert torch.equal(layer.positions[0], kept), f"layer {i}"


@torch.no_grad()
def test_a_padded_row_keeps_what_it_keeps_alone_and_its_sinks():
    model = make_model("llama")
    press = ExpectedAttentionPress(budget=16, min_budget=8)
    ids = torch.cat([prompt(48), prompt(48, seed=1)])
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    alone = prompt(48, seed=1)[:, 6:]
    with press(model):
        batch = greedy(model, ids, mask, new=6, return_dict_in_generate=True)
        single = greedy(model, alone, None, new=6, return_dict_in_generate=True)
    assert torch.equal(batch.sequences[1, 48:], single.sequences[0, 42:])
    for layer in batch.cache.layers:
        assert isinstance(layer, KVLayer)
        kept = layer.positions[1, 0][layer.valid[1, 0]]
        assert set(range(6, 10)) <= set(kept.tolist()) and not (kept < 6).any()
