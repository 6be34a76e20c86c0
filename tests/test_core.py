"""The mechanism every press relies on: hooks, the compressed cache, masks, positions, batching."""

from __future__ import annotations

import copy
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from conftest import ARCHITECTURES, DEVICE, greedy, make_model, make_tokenizer, prompt
from transformers.cache_utils import DynamicSlidingWindowLayer

from sparsekv import (
    CHESSPress,
    ChunkPress,
    H2OPress,
    KVLayer,
    SentencePress,
    SnapKVPress,
    SparseCache,
    StreamingLLMPress,
)
from sparsekv.buffers import GROW, buffer_of, span
from sparsekv.stats import held_tensors

PRESSES = {
    "snapkv": lambda **kw: SnapKVPress(window_size=8, **kw),
    "h2o": lambda **kw: H2OPress(**{"window_size": 1, **kw}),
    "streaming": lambda **kw: StreamingLLMPress(**{"window_size": 1, **kw}),
    "chunkkv": lambda **kw: ChunkPress(window_size=8, chunk_size=4, **kw),
    "sentencekv": lambda **kw: SentencePress(make_tokenizer(), n_sinks=4, window_size=8, **kw),
    # Re-selecting every step: with every ratio at 1 it then attends everything, like the full cache.
    "chess": lambda **kw: CHESSPress(page_size=8, reselect="always", **kw),
}


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def compressed_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, KVLayer)]


@pytest.mark.parametrize("name", PRESSES)
def test_ratio_one_is_identical(any_model, name):
    ids = prompt(64)
    reference = greedy(any_model, ids, new=10)
    with PRESSES[name](ratio=1.0)(any_model):
        out = greedy(any_model, ids, new=10, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert isinstance(out.cache, SparseCache)



@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_the_deprecated_past_key_values_keyword_still_reaches_the_cache():
    """transformers renames a caller's `past_key_values=` to `cache` inside forward, after the hooks ran: the
    hooks must read the name the caller used, or a continued forward would start a new cache."""
    model = make_model("llama")
    with StreamingLLMPress(budget=20, n_sinks=4, window_size=1)(model):
        cache = model(prompt(64)).cache
        out = model(prompt(2, seed=3), past_key_values=cache)
    assert out.cache is cache
    assert all(layer.logical_len == 66 and layer.slots == 20 for layer in compressed_layers(cache))

@pytest.mark.parametrize("name", [n for n in PRESSES if n != "chess"])  # CHESS keeps all: tests/test_chess.py
def test_physical_budget_held(any_model, name):
    ids, new = prompt(100), 12
    with PRESSES[name](budget=30)(any_model):
        out = greedy(any_model, ids, new=new, return_dict_in_generate=True)
    cache = out.cache
    grows = name in ("snapkv", "chunkkv", "sentencekv")  # H2O and StreamingLLM evict while decoding
    whole = 30 - (30 - 8) % 4 if name == "chunkkv" else 30  # whole chunks only: the remainder stays unused
    whole += 4 + 8 if name == "sentencekv" else 0  # tau counts loaded tokens; 4 sinks + 8 recent besides
    for layer in compressed_layers(cache):
        assert layer.keys.shape[-2] == layer.values.shape[-2] == (whole + new - 1 if grows else whole)
        assert layer.logical_len == 100 + new - 1
    stats = cache.stats()
    assert stats.logical_tokens == 100 + new - 1
    assert max(stats.resident_tokens) < 100


def test_sliding_layers_untouched():
    model = make_model("gemma3")
    with SnapKVPress(budget=16, window_size=8)(model):
        out = greedy(model, prompt(64), new=4, return_dict_in_generate=True)
    sliding = out.cache.layers[0]
    assert isinstance(sliding, DynamicSlidingWindowLayer) and sliding.keys.shape[-2] == 7
    assert all(layer.keys.shape[-2] == 16 + 3 for layer in out.cache.layers[1:])


def test_memory_really_drops():
    model = make_model("llama")
    ids = prompt(200)
    full = greedy(model, ids, new=2, return_dict_in_generate=True).cache
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    with SnapKVPress(ratio=0.25, window_size=8)(model):
        cache = greedy(model, ids, new=2, return_dict_in_generate=True).cache
    # 50 kept + 1 generated, in buffers with GROW free slots (appends are written in place)
    assert cache.stats().kv_bytes / full_bytes == pytest.approx((51 + GROW) / 201, abs=1e-6)
    layer = cache.layers[0]
    per_slot = layer.keys[:, :, :1].nbytes
    assert layer.keys.shape[-2] == 51 and layer.keys.untyped_storage().nbytes() == per_slot * (51 + GROW)


def test_appends_are_written_in_place_between_reallocations():
    layer = KVLayer()
    k = torch.randn(2, 3, 10, 4)
    layer.update(k, k + 1)
    layer.select(torch.arange(2, 8).expand(2, 3, 6), torch.ones(2, 6, dtype=torch.bool))
    assert buffer_of(layer.keys, 7) is None  # a gathered tensor has no room: the next append reallocates
    keys, values = [layer.keys], [layer.values]
    news = [torch.randn(2, 3, 1, 4) for _ in range(GROW + 2)]
    ptrs = []
    for new in news:
        layer.update(new, -new)
        keys.append(new)
        values.append(-new)
        ptrs.append(layer.keys.data_ptr())
    assert len(set(ptrs[: GROW + 1])) == 1 and ptrs[GROW + 1] != ptrs[0]  # one reallocation every GROW steps
    assert torch.equal(layer.keys, torch.cat(keys, dim=2)) and torch.equal(layer.values, torch.cat(values, dim=2))
    assert torch.equal(layer.positions[0, 0], torch.cat([torch.arange(2, 8), torch.arange(10, 10 + GROW + 2)]))
    assert layer.valid.shape == (*layer.keys.shape[:2], 6 + GROW + 2) and bool(layer.valid.all())
    assert buffer_of(torch.zeros(1, 5).expand(3, 5), 5) is None  # broadcast views are never written into


def test_span_is_narrow_as_one_op():
    """The appends' views (`layers.span`): what `narrow` gives, strides and offset included, from a view with an
    offset too."""
    t = torch.arange(2 * 4 * 10 * 4).view(2, 4, 10, 4)[:, 1:]
    for dim, start, length in [(2, 3, 4), (1, 1, 2), (2, 10, 0), (3, 2, 2)]:
        view, expected = span(t, dim, start, length), t.narrow(dim, start, length)
        assert torch.equal(view, expected) and view.stride() == expected.stride()
        assert view.storage_offset() == expected.storage_offset() and view._base is t._base


def test_appends_after_an_eviction_or_a_copy_stay_in_place_and_never_touch_another_tensor():
    layer = KVLayer()
    k = torch.randn(1, 2, 6, 4)
    layer.update(k, k.clone())
    layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))  # now a view of a buffer with room
    layer.evict(torch.tensor([[0, 3]]))  # a shorter view of the same buffer: its room is still used
    ptr, expected = layer.keys.data_ptr(), layer.keys.clone()
    new = torch.randn(1, 2, 1, 4)
    layer.update(new, new)
    assert layer.keys.data_ptr() == ptr and torch.equal(layer.keys, torch.cat([expected, new], dim=2))

    copy_ = copy.deepcopy(layer)  # its own storage: appends to it leave the original alone, and vice versa
    before = layer.keys.clone()
    for _ in range(3):
        copy_.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert torch.equal(layer.keys, before)
    assert copy_.keys.untyped_storage().data_ptr() != layer.keys.untyped_storage().data_ptr()
    appended = torch.randn(1, 2, 1, 4)
    layer.update(appended, appended)
    assert torch.equal(layer.keys[:, :, -1:], appended) and torch.equal(layer.keys[:, :, :-1], before)

    shifted = KVLayer()  # a view that starts inside its base is not the base's prefix: a new buffer, base untouched
    base = torch.randn(1, 2, 10, 4)
    shifted.update(base[:, :, 2:6], base[:, :, 2:6].clone())
    snapshot = base.clone()
    shifted.keys = base[:, :, 2:6]
    shifted.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert torch.equal(base, snapshot)


def test_hooks_removed_and_model_unchanged():
    model = make_model("qwen3")
    ids = prompt(40)
    before = model(ids).logits
    hooks = hook_count(model)
    with StreamingLLMPress(ratio=0.5, window_size=1)(model):
        assert hook_count(model) > hooks
        greedy(model, ids)
    assert hook_count(model) == hooks
    assert torch.equal(model(ids).logits, before)


class StepQueries(SnapKVPress):
    captures_step_queries: ClassVar[bool] = True


def test_query_projections_are_hooked_only_for_presses_that_read_step_queries():
    """A press that reads a step's attention (H2O) reads the weights its attention computed: no projection hook."""
    model = make_model("llama")
    projection = model.model.layers[0].self_attn.q_proj
    for press in (SnapKVPress(ratio=0.5, window_size=8), H2OPress(ratio=0.5, window_size=1)):
        with press(model):
            assert not projection._forward_hooks  # a hook would slow every call of it down for nothing
    with StepQueries(ratio=0.5, window_size=8)(model):
        assert len(projection._forward_hooks) == 1
        greedy(model, prompt(40))


def test_hooks_removed_after_exception():
    model = make_model("llama")
    hooks = hook_count(model)
    with pytest.raises(RuntimeError, match="boom"):
        with H2OPress(ratio=0.5, window_size=1)(model):
            greedy(model, prompt(40))
            raise RuntimeError("boom")
    assert hook_count(model) == hooks
    # and the press can be installed again
    with H2OPress(ratio=0.5, window_size=1)(model):
        greedy(model, prompt(40))


def test_press_is_reusable_and_stateless():
    model = make_model("llama")
    press = SnapKVPress(ratio=0.5, window_size=8)
    with press(model):
        first = greedy(model, prompt(60, seed=1))
        greedy(model, prompt(90, seed=2))
        again = greedy(model, prompt(60, seed=1))
    assert torch.equal(first, again)
    assert repr(press) == "SnapKVPress(ratio=0.5, budget=None, window_size=8, kernel_size=15, pooling='max')"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", PRESSES)
def test_batch_with_left_padding_equals_row_by_row(arch, impl, name):
    model = make_model(arch, impl)
    rows = [prompt(50, seed=3)[0], prompt(80, seed=4)[0]]
    ids = torch.zeros(2, 80, dtype=torch.long, device=DEVICE)
    mask = torch.zeros(2, 80, dtype=torch.long, device=DEVICE)
    for i, row in enumerate(rows):
        ids[i, 80 - len(row) :] = row
        mask[i, 80 - len(row) :] = 1
    press = PRESSES[name](ratio=0.4)
    with press(model):
        batched = greedy(model, ids, mask, new=8)
        for i, row in enumerate(rows):
            alone = greedy(model, row[None], new=8)
            assert torch.equal(batched[i, 80:], alone[0, len(row) :]), f"row {i}"


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "gemma3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("new", [1, 3])
def test_absolute_positions_kept(arch, impl, new):
    """After eviction, new tokens must see exactly the kept tokens at their original positions (and each other,
    causally): the compressed cache's logits equal the full cache's with the evicted tokens masked out."""
    model = make_model(arch, impl)
    ids, budget, sinks = prompt(64), 20, 4
    follow = prompt(new, seed=9)
    with StreamingLLMPress(budget=budget, n_sinks=sinks, window_size=1)(model):
        cache = model(ids).cache
        kept = torch.cat([torch.arange(sinks), torch.arange(64 - (budget - sinks), 64)]).to(DEVICE)
        for layer in compressed_layers(cache):
            assert torch.equal(layer.positions.sort(-1).values, kept.expand(1, 2, budget))
        compressed = model(follow, cache=cache, attention_mask=torch.ones(1, 64 + new, device=DEVICE)).logits
    full = model(ids).cache
    mask = torch.zeros(1, 1, new, 64 + new, dtype=torch.bool, device=DEVICE)
    mask[..., kept] = True
    mask[..., 64:] = torch.ones(new, new, dtype=torch.bool, device=DEVICE).tril()
    if impl == "eager":
        mask = torch.zeros(mask.shape, device=DEVICE).masked_fill(~mask, torch.finfo(torch.float32).min)
    reference = model(follow, cache=full, attention_mask=mask).logits
    torch.testing.assert_close(compressed, reference, rtol=1e-4, atol=1e-4)


def test_a_custom_scorer_press_as_in_the_readme():
    from dataclasses import dataclass

    from sparsekv import ScorerPress

    @dataclass
    class KeyNormPress(ScorerPress):
        def score(self, ctx):
            return -ctx.keys.norm(dim=-1)

    model = make_model("llama")
    ids = (torch.randperm(250, generator=torch.Generator().manual_seed(0))[:40] + 3)[None].to(DEVICE)  # no ties
    full = model(ids).cache
    with KeyNormPress(budget=10)(model):
        cache = model(ids).cache
    for layer, reference in zip(compressed_layers(cache), full.layers):
        smallest = reference.keys.norm(dim=-1).topk(10, dim=-1, largest=False).indices.sort(-1).values
        assert torch.equal(layer.positions.sort(-1).values, smallest)


@pytest.mark.parametrize("name", ["h2o", "streaming"])
def test_never_over_budget_across_long_decode(name):
    model = make_model("qwen2", "sdpa")
    with PRESSES[name](budget=24)(model):
        out = model(prompt(70))
        cache = out.cache
        token = out.logits[:, -1:].argmax(-1)
        for step in range(60):
            out = model(token, cache=cache)
            token = out.logits[:, -1:].argmax(-1)
            assert all(layer.keys.shape[-2] == 24 for layer in compressed_layers(cache)), step
    assert cache.get_seq_length() == 130


def left_padded(lengths: tuple[int, ...], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of `lengths` tokens (seeds 0, 1, ...) left-padded to `width`, and their attention mask."""
    ids = torch.zeros(len(lengths), width, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:], mask[i, width - n:] = prompt(n, seed=i)[0], 1
    return ids, mask


def test_streaming_llm_rolls_every_row_of_a_padded_batch_past_a_full_turn():
    """The victim of a step is planned once for every layer: after more steps than a row's window holds, each
    layer and head of each row holds exactly its sinks and its most recent tokens (rows of different budgets)."""
    model = make_model("llama", "sdpa")
    lengths, sinks, steps = (30, 50), 4, 40
    ids, mask = left_padded(lengths, 50)
    with StreamingLLMPress(ratio=0.4, n_sinks=sinks, window_size=1)(model):
        out = greedy(model, ids, mask, new=steps + 1, return_dict_in_generate=True)
    for i, n in enumerate(lengths):
        budget, start, end = round(0.4 * n), 50 - n, 50 + steps
        expected = torch.cat([torch.arange(start, start + sinks), torch.arange(end - (budget - sinks), end)])
        expected = expected.to(DEVICE)
        for layer in compressed_layers(out.cache):
            real = layer.positions[i][:, layer.valid[i, 0]]
            assert torch.equal(real.sort(-1).values, expected.expand(2, -1)), (i, real)


def test_an_eviction_moves_the_newest_slot_into_the_victims_and_a_filler_victim_becomes_real():
    """`KVLayer.evict`: per row and head the victim's slot is gone and the newest token sits in it, every other slot
    as it was; a row with room evicts its filler slot (the same for each head), which then holds a real token."""
    layer = KVLayer()
    b, h, n, d = 2, 3, 6, 4
    keys = torch.randn(b, h, n, d)
    layer.update(keys[:, :, :5], keys[:, :, :5] + 1, valid=torch.tensor([[True] * 5, [False, False] + [True] * 3]))
    layer.compressed = True
    layer.update(keys[:, :, 5:], keys[:, :, 5:] + 1)  # the newest token, real in both rows
    victim = torch.tensor([[2, 0, 4], [0, 0, 0]])  # row 0: real tokens; row 1: its first filler slot
    layer.evict(victim)
    assert layer.slots == n - 1 and torch.equal(
        layer.valid, torch.tensor([[True] * 5, [True, False] + [True] * 3])[:, None].expand(b, h, -1))
    for row in range(b):
        for head in range(h):
            slot = int(victim[row, head])
            assert int(layer.positions[row, head, slot]) == n - 1
            torch.testing.assert_close(layer.keys[row, head, slot], keys[row, head, n - 1])
            torch.testing.assert_close(layer.values[row, head, slot], keys[row, head, n - 1] + 1)
            kept = [i for i in range(n - 1) if i != slot]  # slot i held position i, and still does
            assert layer.positions[row, head, kept].tolist() == kept
            torch.testing.assert_close(layer.keys[row, head, kept], keys[row, head, kept])


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["h2o", "streaming"])
def test_a_step_through_an_evicting_layers_views_decodes_as_the_general_path(name, padded, impl, monkeypatch):
    """An evicting layer's steps write into and scatter through the views its first eviction made: the same
    tokens and logits at every step as the general append and move, with padding (a masked batch) too; between
    steps the layer holds its budget, no more."""
    from sparsekv.buffers import StepViews

    model = make_model("qwen2", impl)
    ids, mask = left_padded((40, 60) if padded else (60, 60), 60)

    def run():
        with PRESSES[name](ratio=0.3)(model):
            return greedy(model, ids, mask, new=30, output_logits=True, return_dict_in_generate=True)

    writes = []
    write = StepViews.write
    monkeypatch.setattr(StepViews, "write", lambda self, *a: writes.append(1) or write(self, *a))
    through_views = run()
    assert len(writes) >= 28 * 3  # every step after the first eviction, in every layer
    monkeypatch.setattr(StepViews, "held_by", lambda self, layer: False)
    general = run()
    assert torch.equal(through_views.sequences, general.sequences)
    torch.testing.assert_close(torch.stack(through_views.logits), torch.stack(general.logits), rtol=1e-5, atol=1e-5)
    for a, b in zip(compressed_layers(through_views.cache), compressed_layers(general.cache)):
        assert a.keys.shape[-2] == round(0.3 * 60) and torch.equal(a.positions, b.positions)


def test_a_per_slot_tensor_replaced_while_decoding_is_refused():
    """While a layer's step views hold its tensors, a press writes its per-slot tensors (`ctx.extra`) in place: one
    replaced by a new tensor would be a copy the views do not write (its next step would read it stale), so the
    step refuses it, naming what to do."""

    class Replacing(H2OPress):
        def after_step(self, ctx):
            ctx.extra["received"] = ctx.extra["received"] + ctx.attention().sum(dim=(2, 3))

    model = make_model("llama")
    with H2OPress(budget=20, window_size=1)(model):
        greedy(model, prompt(40), None, new=6)  # (in place: it decodes)
    with Replacing(budget=20, window_size=1)(model), pytest.raises(RuntimeError, match=r"write it in place"):
        greedy(model, prompt(40), None, new=6)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_steps_queries_are_the_models_own(arch):
    """A decoding step's queries, shaped from the captured projection (`shape_queries`), are the model's own:
    normed and rotated as its attention does, rows at different positions included; `grouped`, each KV head's
    query heads summed before the rotation (RoPE turns them alike) equals their rotated queries summed."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from sparsekv.attention import shape_queries

    model = make_model(arch)
    module = model.model.layers[0].self_attn
    hidden = torch.randn(2, 1, model.config.hidden_size, device=DEVICE)
    cos, sin = model.model.rotary_emb(hidden, torch.tensor([[5], [77]], device=DEVICE))
    projected = module.q_proj(hidden)
    heads = projected.view(2, 1, -1, module.head_dim)
    if getattr(module, "q_norm", None) is not None:
        heads = module.q_norm(heads)
    own, _ = apply_rotary_pos_emb(heads.transpose(1, 2), heads.transpose(1, 2), cos, sin)
    torch.testing.assert_close(shape_queries(module, projected, (cos, sin)), own, rtol=1e-5, atol=1e-5)
    kv = model.config.num_key_value_heads
    grouped = own.view(2, kv, -1, 1, module.head_dim).sum(2)
    torch.testing.assert_close(shape_queries(module, projected, (cos, sin), grouped=True), grouped,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_h2o_keeps_and_scores_alike_under_eager_and_sdpa(padded):
    """The attention H2O adds up, rebuilt from each layer's queries (at a step, its query rotated by one RoPE
    matrix, or one per row in a padded batch), is the same whichever implementation ran the model's attention."""
    kept = {}
    ids, mask = left_padded((40, 60), 60) if padded else (prompt(60), None)
    for impl in ("eager", "sdpa"):
        model = make_model("llama", impl)
        with H2OPress(budget=20, window_size=1)(model):
            seen = mask  # each row's own positions, as generate gives them
            positions = None if seen is None else (seen.cumsum(-1) - 1).clamp(min=0)
            out = model(ids, attention_mask=seen, position_ids=positions)
            cache = out.cache
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(5):
                if seen is not None:
                    seen = torch.cat([seen, torch.ones_like(token)], dim=1)
                    positions = seen.sum(-1, keepdim=True) - 1
                out = model(token, cache=cache, attention_mask=seen, position_ids=positions)
                token = out.logits[:, -1:].argmax(-1)
        kept[impl] = [layer.positions.sort(-1).values for layer in compressed_layers(cache)]
        scores = [layer.extra["received"] for layer in compressed_layers(cache)]
        kept[impl + "-scores"] = [s.gather(-1, layer.positions.argsort(-1)) for s, layer in
                                  zip(scores, compressed_layers(cache))]
    for a, b in zip(kept["eager"], kept["sdpa"]):
        assert torch.equal(a, b)
    for a, b in zip(kept["eager-scores"], kept["sdpa-scores"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)



@torch.no_grad()
def test_victims_shared_by_layers_are_found_once_a_step_and_are_each_layers_own(monkeypatch):
    """StreamingLLM's scores depend on position alone (`scores_by_position`), so the core finds a
    decoding step's victims at its first layer and evicts them from every layer: the same tokens, the same
    slots and the same logits as finding them layer by layer, with one search and one scoring a step instead of
    one a layer."""
    class LayerByLayer(StreamingLLMPress):
        scores_by_position: ClassVar[bool] = False

    searches, scorings = [], []
    victims, score = KVLayer.victims, StreamingLLMPress.score
    monkeypatch.setattr(KVLayer, "victims", lambda layer, *a: searches.append(1) or victims(layer, *a))
    monkeypatch.setattr(StreamingLLMPress, "score", lambda press, *a: scorings.append(1) or score(press, *a))
    model, ids = make_model("llama"), prompt(48, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row: its sinks start later
    found = {}
    for press in (StreamingLLMPress(budget=16, n_sinks=2, window_size=1),
                  LayerByLayer(budget=16, n_sinks=2, window_size=1)):
        searches.clear()
        scorings.clear()
        with press(model):
            out = greedy(model, ids, mask, new=6, return_dict_in_generate=True, output_logits=True)
        layers = out.past_key_values.compressed_layers()
        found[press.label()] = out, [layer.positions for layer in layers], len(searches), len(layers), len(scorings)
    (shared, kept, n_shared, n_layers, scored), (own, own_kept, n_own, _, own_scored) = \
        found["StreamingLLM"], found["LayerByLayer"]
    assert torch.equal(shared.sequences, own.sequences)
    torch.testing.assert_close(torch.stack(shared.logits), torch.stack(own.logits), rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(kept, own_kept))
    assert (n_shared, n_own) == (5, 5 * n_layers) and n_layers > 1  # 5 steps after the prompt
    # Scored at each layer's prompt, then once a step (given a function), where layer by layer scores every layer.
    assert (scored, own_scored) == (n_layers + 5, n_layers + 5 * n_layers)


def test_h2o_received_attention_is_the_full_attention_matrix_summed():
    """What H2O accumulates, rebuilt from queries at the prompt and at each step, is the attention each token
    received: the column sums of eager attention's own matrix over every query so far (a budget the prompt and the
    steps fit, so nothing is evicted)."""
    model = make_model("qwen2", "eager")
    ids, steps = prompt(50), 3
    with H2OPress(budget=64, window_size=1)(model):
        out = model(ids)
        cache, tokens = out.cache, [out.logits[:, -1:].argmax(-1)]
        for _ in range(steps):
            out = model(tokens[-1], cache=cache)
            tokens.append(out.logits[:, -1:].argmax(-1))
    full = model(torch.cat([ids, *tokens[:steps]], dim=1), output_attentions=True).attentions
    for i, layer in enumerate(compressed_layers(cache)):
        n = full[i].shape[-1]
        expected = full[i][0].view(2, -1, n, n).sum(dim=(1, 2))  # (kv_heads, tokens): each GQA group's heads
        got = layer.extra["received"][0].gather(-1, layer.positions[0].argsort(-1))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_snapkv_scores_match_full_attention():
    """The w x L recomputation equals SnapKV computed from the full eager attention matrix."""
    model = make_model("qwen2", "eager")
    ids, w, budget = prompt(80), 8, 24
    attn = model(ids, output_attentions=True).attentions
    press = SnapKVPress(budget=budget, window_size=w)
    with press(model):
        cache = model(ids).cache
    k = press.kernel_size
    for layer_idx, layer in enumerate(compressed_layers(cache)):
        a = attn[layer_idx][0, :, -w:, :].sum(1)  # (heads, L)
        a = a.view(2, 2, 80).mean(1)  # GQA group mean per KV head
        a = F.max_pool1d(a[:, None], k, stride=1, padding=k // 2)[:, 0]
        a[:, -w:] = float("inf")
        kept = torch.zeros_like(a, dtype=torch.bool).scatter(-1, layer.positions[0], True)
        assert int(kept.sum()) == 2 * budget
        # kept tokens are the best scored (ties broken either way, up to float noise between the computations)
        worst_kept = a.masked_fill(~kept, float("inf")).min(-1).values
        best_dropped = a.masked_fill(kept, -1.0).max(-1).values
        assert (worst_kept >= best_dropped - 1e-5).all()


def test_stats_report_logical_resident_attended_and_bytes():
    model = make_model("llama")
    rows = torch.stack([prompt(60, seed=1)[0], prompt(60, seed=2)[0]])
    mask = torch.ones_like(rows)
    mask[0, :20] = 0  # row 0 has 40 real tokens
    with SnapKVPress(ratio=0.5, window_size=8)(model):
        cache = greedy(model, rows, mask, new=1, return_dict_in_generate=True).cache
    stats = cache.stats()
    assert stats.logical_tokens == 60
    assert stats.resident_tokens == [30] * 3  # the largest row budget; row 0 holds 10 filler slots
    assert stats.attended_tokens == [25.0] * 3  # (20 + 30) / 2
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert stats.kv_bytes == kv and stats.bytes_by_device[str(cache.layers[0].keys.device)] > kv
    assert stats.seconds["compress"] > 0


def test_bytes_by_device_count_the_press_state_too():
    """`bytes_by_device` is every tensor the cache holds: the layers' and the press's per-generation state's (here
    CHESS's page sums, on the model's device beside the layers)."""
    model = make_model("llama")
    with CHESSPress(ratio=0.3, page_size=4, page_stride=4, chunk_pages=2, grid_chunks=2)(model):
        cache = greedy(model, prompt(120), new=3, return_dict_in_generate=True).cache
    device = str(cache.layers[0].keys.device)
    layers = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in held_tensors(layer))
    assert cache.stats().bytes_by_device[device] >= layers + cache.state.page_sums.untyped_storage().nbytes()


def test_deepcopy_shares_the_press_and_copies_the_state():
    import copy

    model = make_model("llama")
    press = SnapKVPress(budget=16, window_size=8)
    with press(model), torch.no_grad():
        cache = model(prompt(40)).cache
    clone = copy.deepcopy(cache)
    assert clone.press is press
    assert clone.layers[0].keys is not cache.layers[0].keys
    assert torch.equal(clone.layers[0].keys, cache.layers[0].keys)


@pytest.mark.parametrize("name", ["h2o", "streaming"])
def test_a_copy_made_while_evicting_decodes_as_the_original_and_shares_no_storage(name):
    """A cache copied between two evicting steps (its layers' step views with it) continues as the original does,
    writing into storage of its own: the original's next steps leave the copy as it was."""
    import copy

    model = make_model("qwen2", "sdpa")
    with PRESSES[name](budget=24)(model), torch.no_grad():
        out = model(prompt(70))
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        for _ in range(5):
            out = model(token, cache=cache)
            token = out.logits[:, -1:].argmax(-1)
        twin = copy.deepcopy(cache)
        kept = [layer.keys.clone() for layer in compressed_layers(twin)]
        for _ in range(3):
            model(token, cache=cache)
        assert all(torch.equal(a, layer.keys) for a, layer in zip(kept, compressed_layers(twin)))
        original = copy.deepcopy(twin)
        before = [layer.keys.clone() for layer in compressed_layers(cache)]
        ours, theirs = token, token
        for _ in range(8):
            a, b = model(ours, cache=twin).logits, model(theirs, cache=original).logits
            assert torch.equal(a, b)
            ours = theirs = a[:, -1:].argmax(-1)
        assert all(torch.equal(a, layer.keys) for a, layer in zip(before, compressed_layers(cache)))
    for a, b in zip(compressed_layers(twin), compressed_layers(original)):
        assert torch.equal(a.positions, b.positions) and a.keys.shape[-2] == 24


def test_prompt_kept_marks_what_attention_reads():
    model = make_model("llama", "sdpa")
    with StreamingLLMPress(budget=12, n_sinks=4, window_size=1)(model):
        out = greedy(model, prompt(40), new=1, return_dict_in_generate=True)
    kept = out.cache.prompt_kept()
    expected = torch.zeros(40, dtype=torch.bool)
    expected[:4] = expected[-8:] = True  # the sinks and the most recent tokens
    assert sorted(kept) == [0, 1, 2]
    for mask in kept.values():
        assert mask.shape == (1, 2, 40) and bool((mask.cpu() == expected).all())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma3"])
def test_decoding_queries_are_the_layers_own_projection_not_a_second_one(arch):
    """`on_queries` sees the step's queries as the layer computed them (normed and rotated as a recomputation
    would), before attention, and the query projection runs once per layer and step."""
    from dataclasses import dataclass

    from sparsekv.attention import project_queries, query_projection

    seen, projections = [], []

    @dataclass
    class QueryReader(SnapKVPress):
        def on_queries(self, ctx):
            seen.append((ctx.call.projected is not None, ctx.queries(), ctx.call, ctx.layer.logical_len))

    model = make_model(arch)
    targets = [m for m in model.modules() if hasattr(m, "layer_idx") and query_projection(m) is not None]
    handles = [query_projection(m).register_forward_hook(lambda *a: projections.append(1)) for m in targets]
    press = QueryReader(ratio=0.5, window_size=8)
    with press(model):
        cache = model(prompt(40)).cache
        layers = len(compressed_layers(cache))
        seen.clear(), projections.clear()
        for step in range(3):
            model(prompt(1, seed=step), cache=cache)
    assert len(projections) == 3 * len(targets)  # gemma3's sliding layers project too, once
    for handle in handles:
        handle.remove()
    assert len(seen) == 3 * layers and all(captured for captured, *_ in seen)
    for _, queries, call, _ in seen:
        recomputed = project_queries(call.module, call.hidden_states, call.position_embeddings)
        torch.testing.assert_close(queries, recomputed)
        # Grouped: each KV head's query heads summed (before RoPE, which turns them alike), as after it.
        b, h_q, n, d = queries.shape
        kv_heads = call.module.config.num_key_value_heads
        assert kv_heads < h_q  # the tiny models have GQA groups
        by_group = queries.view(b, kv_heads, h_q // kv_heads, n, d).sum(2)
        torch.testing.assert_close(call.queries(grouped=True), by_group)
    assert sorted({n for *_, n in seen}) == [40, 41, 42]  # before attention: the step's token not yet cached


def test_row_tensors_are_copied_to_a_device_once_per_value():
    """`SparseCache.on`: the CPU row tensors a step reads on another device are copied there once (a decoding step
    copies nothing to a GPU), and anew when the value changes (a reordered batch); on their own device, as is."""
    model = make_model("llama")
    with StreamingLLMPress(budget=20, n_sinks=4, window_size=1)(model):
        cache = model(prompt(40, batch=2)).cache
    meta = torch.device("meta")  # another device on any machine
    first = cache.on("prompt_start", meta)
    assert first.device == meta and first.shape == (2,) and cache.on("prompt_start", meta) is first
    assert cache.on("prompt_start", cache.prompt_start.device) is cache.prompt_start
    cache.reorder_cache(torch.tensor([1, 0], device=DEVICE))
    again = cache.on("prompt_start", meta)
    assert again is not first and again.device == meta and cache.on("prompt_start", meta) is again
