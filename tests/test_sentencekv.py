"""SentencePress: sentence store off the attention's device, per-sentence retrieval that follows the query."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE, greedy, make_model, make_tokenizer, prompt

from sparsekv import KVLayer, SentenceKVPress, SentencePress, SparseCache
from sparsekv.attention import project_queries, rotate
from sparsekv.context import Context
from sparsekv.buffers import GROW
from sparsekv.presses.sentence_segment import sentence_ids
from sparsekv.presses.sentence_state import SentenceState
from sparsekv.presses.sentence_step import load, loading_room, rank_in_sentence


def press(**kw):
    return SentencePress(make_tokenizer(), **{"n_sinks": 4, "window_size": 8, **kw})


def sentence_prompt(n: int, seed: int = 0) -> torch.Tensor:
    """Random ids with a sentence end (".") every 6 to 15 tokens."""
    ids = prompt(n, seed=seed)
    period = make_tokenizer().convert_tokens_to_ids(".")
    g = torch.Generator().manual_seed(seed)
    i = 0
    while i < n:
        i += int(torch.randint(6, 16, (1,), generator=g))
        if i < n:
            ids[0, i] = period
    return ids


def padded_prefill() -> SparseCache:
    """The cache of two 90-token sentence prompts (row 1 left-padded by 9) after the prompt, budget 30."""
    model = make_model("llama")
    ids = torch.cat([sentence_prompt(90, seed=1), sentence_prompt(90, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    with press(budget=30)(model), torch.no_grad():
        return model(ids, attention_mask=mask).cache


def compressed(cache):
    return [layer for layer in cache.layers if isinstance(layer, KVLayer)]


def ranking(cache, layer_idx: int):
    """Layer `layer_idx`'s ranking state: views of its slice of the stack (`LayerStack.at`)."""
    stack, rank = cache.state.find(layer_idx)
    return stack.at(rank)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_budget_and_memory_held_at_every_step(impl):
    model = make_model("qwen2", impl)
    n, tau, r = 120, 30, 2
    p = press(budget=tau, keep_factor=r)
    with p(model), torch.no_grad():
        out = model(sentence_prompt(n))
        cache = out.cache
        token = out.logits[:, -1:].argmax(-1)
        for step in range(1, 16):
            out = model(token, cache=cache)
            token = out.logits[:, -1:].argmax(-1)
            for layer in compressed(cache):
                assert layer.keys.shape[-2] == tau + 12 + step  # tau loaded + 4 sinks + 8 recent + generated
                assert int(layer.valid[:, 0].sum()) == tau + 12 + step  # every slot real
                prompt_slots = layer.positions[0, :, layer.positions[0, 0] < n]
                assert prompt_slots.shape[-1] == tau + 12 and (prompt_slots[:, :4] >= 0).all()
                assert set(range(4)) <= set(prompt_slots[0].tolist()) and set(range(n - 8, n)) <= set(
                    prompt_slots[0].tolist())
                assert layer.store_keys.shape[-2] == r * tau  # r * tau kept besides the sinks and window
                assert layer.store_keys.device == torch.device(p.offload_device)
                assert layer.store_keys.data_ptr() != layer.keys.data_ptr()
    stats = cache.stats()
    per_token = 2 * 2 * 16 * 4  # keys + values, 2 KV heads, head_dim 16, float32
    # tau + 12 + 15 generated slots, in a buffer made at the first step with GROW free slots for in-place appends
    assert stats.kv_bytes == len(compressed(cache)) * (tau + 12 + 1 + GROW) * per_token
    assert stats.offloaded_bytes == len(compressed(cache)) * r * tau * per_token
    assert stats.counts["selections"] == 15 * len(compressed(cache))
    assert 0 < stats.counts["loads"] <= stats.counts["selections"]
    assert {"compress", "step"} <= set(stats.seconds)


LAYER0 = SimpleNamespace(module=SimpleNamespace(layer_idx=0))  # what `after_step` reads of layer 0's call


def fake_call(queries):
    """What `on_queries` reads from layer 0's attention call: this step's queries and their validity."""
    valid = torch.ones(queries.shape[0], queries.shape[2], dtype=torch.bool)
    return SimpleNamespace(queries=lambda start=0, end=None, grouped=False: queries, valid=lambda: valid,
                           module=SimpleNamespace(layer_idx=0))


def two_sentence_layer(p, fill: int = 4, loaded: int = 4):
    """A compressed layer 0, 1 KV head: `loaded` slots (`fill` of them real) and a store of two 4-token sentences
    whose mean keys are e0 and e1 (positions 100-103, 104-107); and what the press's decoding hooks read and write
    on the cache: counters, the forward (its token, every input token real), the ranking state (which token ids
    end a sentence: id 1 only)."""
    layer = p.new_layer(0)
    d, store = 4, 8
    layer.update(torch.zeros(1, 1, loaded + 12, d), torch.zeros(1, 1, loaded + 12, d))  # + 12 resident slots
    layer.compressed, layer.region = True, torch.arange(loaded)[None] < fill
    keys = torch.zeros(1, 1, store, d)
    keys[..., :4, 0], keys[..., 4:, 1] = 1.0, 1.0  # sentence 0: direction e0, sentence 1: e1
    keys[..., 2] = torch.arange(store)  # tells the tokens apart
    layer.store_keys, layer.store_values = keys, -keys
    layer.store_positions = torch.arange(100, 100 + store)[None]
    state, slot_sentence, sizes = SentenceState(), torch.tensor([[[0, 0, 0, 0, 1, 1, 1, 1]]]), torch.tensor([[[4, 4]]])
    state.closes = torch.tensor([False, True, False])
    state.add_layer(0, query_sum=torch.zeros(1, 1, 1, d), slot_sentence=slot_sentence, sentence_sizes=sizes,
                    slot_room=loading_room(slot_sentence, sizes, torch.tensor([[[fill]]])),
                    sentence_keys=torch.tensor([[1.0, 0, 1.5, 0], [0, 1.0, 5.5, 0]])[None, None],
                    resident=torch.zeros(1, 1, store, dtype=torch.bool),
                    device_slot=torch.zeros(1, 1, store, dtype=torch.long))
    stack, rank = state.find(0)
    load(layer, stack, rank, SentencePress.chosen(stack.at(rank)), first=True)  # as compress does: sentence 0 first
    cache = SimpleNamespace(state=state, forward=SimpleNamespace(input_ids=torch.tensor([[0]]), input_valid=None),
                            compiled=False)
    return layer, cache


def counts(cache) -> dict[str, int]:
    """The ranking events the press counted on the device, by kind (what `stats().counts` adds up)."""
    return cache.state.event_counts()


@contextmanager
def attention_inputs(model):
    """Each layer's attention keyword inputs (`hidden_states`, `position_embeddings`, ...) of the last forward."""
    inputs = {}

    def record(module, args, kwargs):
        inputs[module.layer_idx] = kwargs

    hooks = [m.self_attn.register_forward_pre_hook(record, with_kwargs=True) for m in model.model.layers]
    try:
        yield inputs
    finally:
        for hook in hooks:
            hook.remove()


def loaded_positions(layer, n: int) -> list[int]:
    """Positions of the first `n` loaded slots, sorted, after checking each slot holds its store token's KV."""
    positions = layer.positions[0, 0, :n]
    expected = layer.store_keys[0, 0, positions - 100]
    assert torch.equal(layer.keys[0, 0, :n], expected) and torch.equal(layer.values[0, 0, :n], -expected)
    return sorted(positions.tolist())


def test_selection_follows_the_query_and_resets_at_sentence_ends():
    """Two sentences with orthogonal mean keys: the loaded one is the one the generated sentence's mean query
    points at, and it changes once a sentence ends and the next one points elsewhere."""
    p = press(budget=4, rank_at="layer")  # 4 loaded slots, ranked at each query
    (layer, cache), d = two_sentence_layer(p), 4
    toward = lambda i: torch.eye(d)[i].view(1, 1, 1, d)  # noqa: E731
    p.on_queries(Context(cache, layer, fake_call(toward(0))))
    assert loaded_positions(layer, 4) == [100, 101, 102, 103]
    p.after_step(Context(cache, layer, LAYER0))
    p.on_queries(Context(cache, layer, fake_call(2 * toward(1))))  # the mean of e0 and 2 e1 still leans to e1
    assert loaded_positions(layer, 4) == [104, 105, 106, 107] and counts(cache)["loads"] == 1
    p.on_queries(Context(cache, layer, fake_call(toward(1))))  # same selection: nothing loaded
    assert counts(cache) == {"loads": 1, "selections": 3, "loaded_tokens": 4}
    cache.forward.input_ids = torch.tensor([[1]])  # the step's token ends a sentence
    p.after_step(Context(cache, layer, LAYER0))  # the sentence ended: a fresh mean query
    assert not ranking(cache, 0).query_sum.any()
    p.on_queries(Context(cache, layer, fake_call(0.1 * toward(0))))
    assert loaded_positions(layer, 4) == [100, 101, 102, 103]


def test_only_tokens_entering_the_selection_are_copied():
    """6 loaded slots: the best sentence whole, then the other's first 2 tokens. When the query turns, the 4
    tokens kept by both selections stay in their slots; the 2 that enter take the slots of the 2 that leave."""
    p = press(budget=6, rank_at="layer")
    layer, cache = two_sentence_layer(p, fill=6, loaded=6)
    p.on_queries(Context(cache, layer, fake_call(torch.eye(4)[0].view(1, 1, 1, 4))))
    assert loaded_positions(layer, 6) == [100, 101, 102, 103, 104, 105]
    before = layer.positions[0, 0, :6].clone()
    p.on_queries(Context(cache, layer, fake_call(3 * torch.eye(4)[1].view(1, 1, 1, 4))))
    assert loaded_positions(layer, 6) == [100, 101, 104, 105, 106, 107]
    stayed = torch.isin(before, torch.tensor([100, 101, 104, 105]))
    assert torch.equal(layer.positions[0, 0, :6][stayed], before[stayed])  # not moved
    assert counts(cache)["loaded_tokens"] == 2


def test_a_row_filling_fewer_slots_loads_its_best_tokens_and_leaves_the_filler():
    p = press(budget=4, rank_at="layer")
    layer, cache = two_sentence_layer(p, fill=3)
    p.on_queries(Context(cache, layer, fake_call(torch.eye(4)[1].view(1, 1, 1, 4))))
    assert loaded_positions(layer, 3) == [104, 105, 106]  # sentence 1's first three tokens
    assert layer.positions[0, 0, 3] == 3 and not layer.keys[0, 0, 3].any()  # the filler slot is never written


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_prompt_ending_inside_a_sentence_starts_the_mean_query(impl):
    """Row 0's prompt ends inside a sentence (as an answer prefix does): after the prompt, each layer's query
    sum is that sentence's own queries, recomputed here from the layer's input. Row 1 (left-padded) ends with
    a sentence end, so it starts empty, as does every row with `prompt_sentence=False`."""
    model, tok = make_model("qwen2", impl, vocab_size=420), make_tokenizer()  # every id of the tokenizer
    text = " ".join(["The cat sat on the mat near the door.", "A dog ran far away!"] * 3)
    open_ids, ended = (tok(text + end, return_tensors="pt").input_ids for end in (" The number is", " Done."))
    pad = open_ids.shape[1] - ended.shape[1]
    batch = torch.cat([open_ids, torch.cat([torch.zeros(1, pad, dtype=torch.long), ended], dim=1)]).to(DEVICE)
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    sentences = sentence_ids(tok, open_ids)[0]
    last = int((sentences == sentences[-1]).nonzero().min())
    assert last > 0  # a strict suffix of the prompt
    for p in (press(budget=30), press(budget=30, prompt_sentence=False)):
        with attention_inputs(model) as inputs, p(model), torch.no_grad():
            cache = model(batch, attention_mask=mask).cache
        for i, layer in enumerate(cache.layers):
            kw = inputs[i]
            cos, sin = kw["position_embeddings"]
            queries = project_queries(model.model.layers[i].self_attn, kw["hidden_states"][:1, last:],
                                      (cos[:1, last:], sin[:1, last:]))
            per_kv_head = queries.sum(dim=2).view(1, layer.keys.shape[1], -1, queries.shape[-1])
            per_kv_head = per_kv_head.sum(dim=2, keepdim=True)
            query_sum = ranking(cache, i).query_sum
            expected = per_kv_head if p.prompt_sentence else torch.zeros_like(query_sum[:1])
            torch.testing.assert_close(query_sum[:1], expected, rtol=1e-4, atol=1e-4)
            assert not query_sum[1].any()


@dataclass(kw_only=True)
class RankedBeforeTheQuery(SentencePress):
    """The definition of `rank_at="step"`, written per layer: each layer ranks and loads with its sum of the queries
    before the step's, and a row whose sentence has no query yet keeps its selection; then the query joins."""

    rank_at: str = "layer"  # the per-layer path, changed here

    def on_queries(self, ctx):
        stack, rank = ctx.state.find(ctx.layer_idx)
        state = stack.at(rank)
        chosen = self.chosen(state)
        empty = (state.query_sum == 0).flatten(1).all(1)
        load(ctx.layer, stack, rank, torch.where(empty[:, None, None], state.resident, chosen))
        queries = ctx.queries(grouped=True).float()
        if ctx.forward.input_valid is not None:
            queries = queries * ctx.forward.input_valid[:, None, :, None]
        state.query_sum.add_(queries.sum(dim=2, keepdim=True))


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_ranking_at_the_step_loads_what_each_layer_would_with_the_queries_before_the_step(arch, rows):
    """`rank_at="step"` ranks and loads every layer when a step begins: the same slots, KV and logits as each layer
    ranking at its own query with the sums of the queries before the step's (one row, and a padded batch of two;
    the tokens fed end a sentence twice, so the sums restart and a row keeps its selection while its new sentence
    is empty). Llama's queries are kept as projections and rotated for every layer at once after the last (one
    RoPE matrix for the step, or one per row), Gemma3's (normed per layer) each at its layer; the padding of
    sentences between layers (each keeps its own count) is never loaded."""
    model = make_model(arch, vocab_size=420)
    ids = torch.cat([sentence_prompt(90, seed=1), sentence_prompt(90, seed=2)])[:rows]
    mask = torch.ones_like(ids)
    mask[1:, :9] = 0
    ids = ids.masked_fill(mask == 0, 0)
    period = make_tokenizer().convert_tokens_to_ids(".")
    fed = prompt(12, batch=2, seed=5)[:rows]
    fed[:, 3], fed[0, 8] = period, period
    runs = []
    for p in (press(budget=30, rank_at="step"), RankedBeforeTheQuery(make_tokenizer(), n_sinks=4, window_size=8,
                                                                   budget=30)):
        with p(model), torch.no_grad():  # each row's own positions, as generate gives them
            out = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
            seen, logits = mask, []
            for t in range(fed.shape[1]):
                seen = torch.cat([seen, torch.ones_like(fed[:, :1])], dim=1)
                out = model(fed[:, t:t + 1], attention_mask=seen, cache=out.cache,
                            position_ids=seen.sum(-1, keepdim=True) - 1)
                logits.append(out.logits[:, -1])
        runs.append((out.cache, torch.stack(logits, 1)))
    (at_step, at_step_logits), (reference, reference_logits) = runs
    assert at_step.stats().counts["loads"] > 0
    torch.testing.assert_close(at_step_logits, reference_logits)
    for a, b in zip(compressed(at_step), compressed(reference)):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)
    torch.testing.assert_close(at_step.state.stacks[0].query_sum, reference.state.stacks[0].query_sum)


@pytest.mark.parametrize("rank_at", ["step", "layer"])
def test_loads_from_an_offloaded_store_match_loads_from_one_beside_the_model(rank_at, monkeypatch):
    """The path a GPU takes with its store on the host (SentencePress's default there: `offloaded`), taken on the
    device the tests run on: the entering slots moved to the store's side once, every loading layer's rows
    gathered into one buffer and copied over (`rank_at="step"`), or each layer's (`rank_at="layer"`), give the same
    working sets, positions and logits as loads from a store beside the model."""
    import sparsekv.store

    model = make_model("llama", vocab_size=420)
    ids = torch.cat([sentence_prompt(90, seed=1), sentence_prompt(90, seed=2)])
    fed = prompt(10, batch=2, seed=5)
    runs = []
    for away in (False, True):
        calls = []

        def elsewhere(store, device, away=away, calls=calls):
            calls.append(store.shape)
            return away or store.device != device

        monkeypatch.setattr(sparsekv.store, "offloaded", elsewhere)
        with press(budget=30, rank_at=rank_at)(model), torch.no_grad():
            out = model(ids)
            logits = []
            for t in range(fed.shape[1]):
                out = model(fed[:, t:t + 1], cache=out.cache)
                logits.append(out.logits[:, -1])
        assert calls and out.cache.stats().counts["loads"] > 0
        runs.append((out.cache, torch.stack(logits, 1)))
    (beside, beside_logits), (away, away_logits) = runs
    torch.testing.assert_close(away_logits, beside_logits, rtol=0, atol=0)
    for a, b in zip(compressed(away), compressed(beside)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.positions, b.positions)


def test_layers_on_several_devices_are_stacked_per_device():
    """Layers on two devices (a `device_map` over GPUs; here layer 1's ranking state on the meta device) each join
    the stack of their device, in the order they compress, and each finds its own rank there."""
    cache = padded_prefill()
    parts = {name: getattr(ranking(cache, 0), name) for name in ("query_sum", "sentence_keys", "sentence_sizes",
                                                                 "slot_sentence", "slot_room", "resident",
                                                                 "device_slot")}
    state = SentenceState()
    for i, device in enumerate(["cpu", "meta", "cpu"]):
        state.add_layer(i, **{name: t.to(device) for name, t in parts.items()})
    assert len(state.stacks) == 2 and [stack.ranks for stack in state.stacks] == [{0: 0, 2: 1}, {1: 0}]
    assert state.find(2) == (state.stacks[0], 1) and state.find(1) == (state.stacks[1], 0) and state.find(3) is None
    assert state.stacks[0].query_sum.shape[1] == 2 and state.stacks[1].query_sum.device.type == "meta"


def test_a_layer_with_more_sentences_widens_the_stack_before_its_empty_sentence():
    """Each layer keeps its own count of sentences; stacked, every layer's are padded to the most, before its
    empty sentence (the one of empty store slots), which stays last: ranking is unchanged."""
    gen = torch.Generator().manual_seed(0)

    def parts(s):
        sizes = torch.randint(1, 4, (1, 1, s), generator=gen)  # at most 12 stored tokens
        sizes[..., -1] = 0
        slot_sentence = torch.repeat_interleave(torch.arange(s), sizes[0, 0])
        slot_sentence = torch.cat([slot_sentence, torch.full((12 - len(slot_sentence),), s - 1)])[None, None]
        fill = torch.tensor([[[4]]])
        return {"query_sum": torch.randn(1, 1, 1, 4, generator=gen),
                "sentence_keys": torch.randn(1, 1, s, 4, generator=gen), "sentence_sizes": sizes,
                "slot_sentence": slot_sentence, "slot_room": loading_room(slot_sentence, sizes, fill),
                "resident": torch.zeros(1, 1, 12, dtype=torch.bool),
                "device_slot": torch.zeros(1, 1, 12, dtype=torch.long)}

    layers = [parts(3), parts(5), parts(4)]
    state = SentenceState()
    for i, layer in enumerate(layers):
        state.add_layer(i, **layer)
    stack = state.stacks[0]
    assert stack.sentence_keys.shape[:4] == (1, 3, 1, 5)
    for i, layer in enumerate(layers):
        s = layer["sentence_sizes"].shape[-1]
        assert torch.equal(stack.sentence_sizes[0, i, 0, s - 1:-1], torch.zeros(5 - s, dtype=torch.long))
        assert stack.sentence_sizes[0, i, 0, -1] == 0 and (stack.slot_sentence[:, i] < 5).all()
        empty = layer["slot_sentence"] == s - 1
        assert (stack.slot_sentence[:, i][empty] == 4).all()
        assert torch.equal(SentencePress.chosen(stack.at(i)), SentencePress.chosen(SimpleNamespace(**layer)))


def test_the_loaded_region_holds_store_tokens_from_the_prompt_on():
    """Right after the prompt (no decoding step yet), every real loaded slot holds a stored token's KV, on every
    head of both rows (one left-padded): decoding that cache attends no placeholder."""
    cache = padded_prefill()
    for layer in compressed(cache):
        for row in range(2):
            fill = int(layer.valid[row, 0, :layer.loaded].sum())
            assert fill > 0 and layer.valid[row, :, :fill].all()
            for head in range(layer.keys.shape[1]):
                positions = layer.positions[row, head, :fill]
                slot = (layer.store_positions[row][None] == positions[:, None]).float().argmax(-1)
                assert torch.equal(layer.store_positions[row, slot], positions)  # a stored token, no placeholder
                slot = slot.to(layer.store_keys.device)  # the store may be offloaded (SentencePress's default)
                assert torch.equal(layer.keys[row, head, :fill].cpu(), layer.store_keys[row, head, slot].cpu())
                assert torch.equal(layer.values[row, head, :fill].cpu(), layer.store_values[row, head, slot].cpu())


@pytest.mark.parametrize("centre,vector", [(True, "mean"), (False, "mean"), (True, "bounds")])
def test_sentence_vectors_come_from_the_kept_keys_relative_to_the_prompt_mean(centre, vector):
    """Each sentence's vector, recomputed from the layer's key projection: the mean over its stored tokens of
    the key minus the prompt's mean key (before RoPE, then rotated to the token's position) with `centre`,
    of the cached key without; with `sentence_vector="bounds"`, each channel's max and min of the same keys.
    Batch of 2 with left padding: padding is in no mean or bound."""
    model, tok = make_model("qwen2", vocab_size=420), make_tokenizer()
    tok.padding_side = "left"
    lines = ["The cat sat on the mat.", "A dog ran far away!", "Is it raining?", "We left at noon."]
    batch = tok([" ".join(lines * 4), " ".join(lines[::-1] * 3)], return_tensors="pt", padding=True)
    ids, mask = batch.input_ids.to(DEVICE), batch.attention_mask.to(DEVICE)
    assert not mask[1, 0]  # the second row is left-padded
    with attention_inputs(model) as inputs, press(budget=30, centre=centre, sentence_vector=vector)(model), \
            torch.no_grad():
        cache = model(ids, attention_mask=mask).cache
    for i, layer in enumerate(cache.layers):
        attn, kw = model.model.layers[i].self_attn, inputs[i]
        b, n = ids.shape
        with torch.no_grad():
            plain = attn.k_proj(kw["hidden_states"]).view(b, n, -1, attn.head_dim).transpose(1, 2)
        weight = mask[:, None, :, None].float()
        mean = (plain * weight).sum(2, keepdim=True) / weight.sum(2, keepdim=True) if centre else 0.0
        keys = rotate(plain - mean, kw["position_embeddings"])
        state = ranking(cache, i)
        empty = state.sentence_keys.shape[2] - 1  # the sentence of empty store slots
        for row in range(b):
            stored = layer.store_positions[row]
            sentence = state.slot_sentence[row, 0]
            assert len(sentence[sentence != empty].unique()) > 3
            for s_id in sentence[sentence != empty].unique().tolist():
                at = stored[sentence == s_id]
                kept = keys[row, :, at]
                expected = kept.mean(1) if vector == "mean" else torch.cat([kept.amax(1), kept.amin(1)], -1)
                torch.testing.assert_close(state.sentence_keys[row, :, s_id], expected, rtol=1e-4, atol=1e-4)


def test_a_sentence_bound_is_the_most_any_of_its_keys_can_score():
    """`sentence_vector="bounds"`: a sentence scores at least every one of its keys' `q . k`, exactly that of a
    one-token sentence; a sentence holding the one key that matches the query outranks those without, which
    the mean of its keys does not (the matching key diluted by the others)."""
    gen = torch.Generator().manual_seed(0)
    d, q = 8, torch.randn(1, 1, 1, 8, generator=gen)
    noise = torch.randn(1, 1, 2, 6, d, generator=gen) * 0.5  # 2 sentences of 6 tokens
    noise[0, 0, 0, 0] = q[0, 0, 0] * 2  # sentence 0 holds a key matching the query ...
    noise[0, 0, 0, 1:] -= q[0, 0, 0] * 0.6  # ... among keys that turn away from it
    single = torch.randn(1, 1, 1, d, generator=gen)  # sentence 2: one token
    keys = [noise[:, :, 0], noise[:, :, 1], single]
    bounds = torch.stack([torch.cat([k.amax(2), k.amin(2)], -1) for k in keys], dim=2)
    means = torch.stack([k.mean(2) for k in keys], dim=2)
    score = {v: SentencePress.similarity(SimpleNamespace(query_sum=q, sentence_keys=k))[0, 0]
             for v, k in (("bounds", bounds), ("mean", means))}
    for s, k in enumerate(keys):
        assert bool((score["bounds"][s] >= (k[0, 0] @ q[0, 0, 0]).max() - 1e-5).all())
    torch.testing.assert_close(score["bounds"][2], single[0, 0, 0] @ q[0, 0, 0])
    assert score["bounds"][0] > score["bounds"][1] and score["mean"][0] < score["mean"][1]


def test_sentence_ranks():
    sentence = torch.tensor([[0, 0, 2, 2, 2, 1, 3, 3]])  # ids need not follow positions (split sentences)
    assert rank_in_sentence(sentence, 4).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1]]


@pytest.mark.parametrize("seed", range(5))
def test_chosen_slots_are_the_best_sentences_first_tokens_up_to_fill(seed):
    """Per row and KV head: sentences by similarity, best first, each giving its stored tokens in position order
    until the row's `fill` loaded slots are taken (the last sentence cut); empty store slots never."""
    gen = torch.Generator().manual_seed(seed)
    b, h, n_sentences, d = 2, 3, 7, 4
    sizes = torch.randint(0, 5, (b, 1, n_sentences), generator=gen)
    sizes[..., -1] = 0  # the sentence of empty store slots
    slots = int(sizes.sum(-1).max()) + 3
    slot_sentence = torch.full((b, 1, slots), n_sentences - 1)
    for row in range(b):
        stored = torch.repeat_interleave(torch.arange(n_sentences), sizes[row, 0])
        slot_sentence[row, 0, : len(stored)] = stored
    fill = torch.randint(1, int(sizes.sum(-1).min()) + 1, (b, 1, 1), generator=gen)
    layer = SimpleNamespace(state=SimpleNamespace(
        sentence_sizes=sizes, slot_sentence=slot_sentence.expand(b, h, slots),
        sentence_keys=torch.randn(b, h, n_sentences, d, generator=gen),
        query_sum=torch.randn(b, h, 1, d, generator=gen)))
    layer.state.slot_room = loading_room(slot_sentence, sizes, fill)
    chosen = SentencePress.chosen(layer.state)
    similarity = torch.einsum("bhxd,bhsd->bhs", layer.state.query_sum, layer.state.sentence_keys)
    for row in range(b):
        for head in range(h):
            expected, left = torch.zeros(slots, dtype=torch.bool), int(fill[row])
            for s in similarity[row, head].argsort(descending=True, stable=True).tolist():
                for slot in (slot_sentence[row, 0] == s).nonzero()[:, 0].tolist():
                    if left and s != n_sentences - 1:
                        expected[slot], left = True, left - 1
            assert torch.equal(chosen[row, head], expected), (row, head)
            assert int(chosen[row, head].sum()) == int(fill[row])


def test_ratio_one_is_identical():
    model = make_model("llama")
    ids = sentence_prompt(70)
    with press(ratio=1.0)(model):
        out = greedy(model, ids, new=8)
    assert torch.equal(out, greedy(model, ids, new=8))


def test_alias_repr_and_errors():
    assert SentenceKVPress is SentencePress
    assert "tokenizer" not in repr(press(budget=64))
    with pytest.raises(ValueError, match="tokenizer is required"):
        SentencePress(budget=64)
    with pytest.raises(ValueError, match="prompt_sentence must be True or False"):
        press(budget=64, prompt_sentence=1)
    with pytest.raises(ValueError, match="keep_factor must be a number >= 1"):
        press(budget=64, keep_factor=0.5)
    with pytest.raises(ValueError, match="offload_device"):
        press(budget=64, offload_device="floppy")
    with pytest.raises(ValueError, match="sentence_vector must be 'mean' \\(eq. 1\\) or 'bounds'; got 'max'"):
        press(budget=64, sentence_vector="max")
    model = make_model("llama")
    with press(budget=20)(model), pytest.raises(ValueError, match="needs input_ids"):
        model(inputs_embeds=model.get_input_embeddings()(prompt(40)))
    assert isinstance(SparseCache(press(budget=20), model.config).layers[0], KVLayer)


def test_an_offloaded_stores_rows_are_gathered_by_one_flat_index():
    """`load_layers` from a store on another device moves one flat index there, not three, and gathers every
    loading layer's rows into one buffer (one copy to the GPU per tensor): the rows gathered are
    each store's `(row, head, slot)` rows, one store's after the other, in order."""
    from sparsekv.store import flat_index, gather_rows

    gen = torch.Generator().manual_seed(0)
    keys, other = torch.randn(2, 3, 10, 4, generator=gen), torch.randn(2, 3, 10, 4, generator=gen)
    row, head, slot = torch.tensor([1, 0, 1, 1]), torch.tensor([2, 0, 0, 2]), torch.tensor([9, 3, 0, 4])
    index = flat_index(keys, row, head, slot)
    assert torch.equal(gather_rows([keys], [index]), keys[row, head, slot])
    both = gather_rows([keys, other], [index, index[1:3]])
    assert torch.equal(both, torch.cat([keys[row, head, slot], other[row[1:3], head[1:3], slot[1:3]]]))
    strided = keys.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, laid out otherwise
    assert torch.equal(gather_rows([strided, keys], [index, index]), torch.cat([keys[row, head, slot]] * 2))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_host_read_loads_what_two_do(seed):
    """On a GPU `load` finds the tokens that enter and those that leave with one `nonzero` (one wait for the
    device), on a CPU with two: both leave every layer with the same working set and bookkeeping."""
    cache = padded_prefill()
    gen = torch.Generator().manual_seed(seed)
    for i, layer in enumerate(cache.layers):
        stack, rank = cache.state.find(i)
        state = stack.at(rank)
        state.query_sum.copy_(torch.randn(state.query_sum.shape, generator=gen))
        chosen = SentencePress.chosen(state)
        twin, twin_stack = copy.deepcopy((layer, stack))
        load(layer, stack, rank, chosen, one_read=True)
        load(twin, twin_stack, rank, chosen, one_read=False)
        for name in ("keys", "values", "positions"):
            assert torch.equal(getattr(layer, name), getattr(twin, name)), name
        assert torch.equal(stack.device_slot, twin_stack.device_slot)
        assert torch.equal(stack.resident, twin_stack.resident)
        assert torch.equal(stack.counts, twin_stack.counts)
    assert cache.state.event_counts()["loaded_tokens"] > 0  # a new mean query moved tokens in and out
