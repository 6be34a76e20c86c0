"""Every `generate` mode under every press: each works correctly (as asserted here) or is refused clearly.

The presses are found by existing: every `Press` subclass defined in sparsekv (`registered_presses`), built with
options small enough for the tiny models (`tiny_press`), so a new press joins this matrix without editing it.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import byte_tokenizer, greedy, make_model, make_tokenizer, prompt
from transformers import DynamicCache, GenerationConfig

import sparsekv
from sparsekv import CHESSPress, KVzipPress, Press, ScorerPress, SentencePress, SnapKVPress, SparseCache, StoreLayer
from sparsekv.presses.sentence_segment import closes_sentence


def registered_presses() -> list[type[Press]]:
    """Every concrete press class sparsekv defines (aliases once)."""
    found, todo = [], [Press]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        base = cls in (Press, ScorerPress) or (issubclass(cls, ScorerPress) and cls.score is ScorerPress.score
                                               and cls.compress is ScorerPress.compress)  # (KVzip keeps its own way)
        if cls.__module__.startswith("sparsekv.") and not base and cls not in found:
            found.append(cls)
    return sorted(found, key=lambda c: c.__name__)


@dataclasses.dataclass(kw_only=True)
class SentencePressRankedPerLayer(SentencePress):
    """`SentencePress(rank_at="layer")` (the paper's order), whose decoding path is its own: in every test too."""

    rank_at: str = "layer"


PRESSES = registered_presses() + [SentencePressRankedPerLayer]
# Options sized for 64-token prompts, applied where a press has the field; CHESS re-selects at every step.
TINY = {"window_size": 8, "min_budget": 8, "chunk_size": 4, "page_size": 8, "n_sinks": 4, "reselect": "always",
        "n_sink": 8, "interval": 3}
ARCHS = ("llama", "qwen3", "phi3", "gemma3")


def tiny_press(cls, **budget) -> Press:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    if "press" in names:  # a wrapper (AdaKV, Decoding): over SnapKV, whose options take the budget
        return cls(tiny_press(SnapKVPress, **budget), **{k: v for k, v in TINY.items() if k in names})
    # (KVzip feeds the model its own text: a tokenizer of exactly the tiny models' vocabulary)
    args = ((byte_tokenizer() if cls is KVzipPress else make_tokenizer()),) if "tokenizer" in names else ()
    if "budget" in budget and "budget" not in names:  # CHESS's budget is what a step reads
        budget = {"read_budget": budget["budget"]}
    return cls(*args, **{k: v for k, v in TINY.items() if k in names}, **(budget or {"ratio": 0.25}))


def acts_while_decoding(cls) -> bool:
    """Whether a press does anything after the prompt (else it compresses the prompt only)."""
    phases = ("begin_forward", "choose", "on_queries", "after_step", "score_step", "end_forward")
    return any(getattr(cls, m) is not getattr(Press, m) for m in phases)


def padded_batch(length: int = 64, pad: int = 5):
    ids = prompt(length, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_the_matrix_has_every_press():
    assert {c.__name__ for c in PRESSES} >= {"CHESSPress", "ChunkPress", "H2OPress", "SentencePress",
                                              "SnapKVPress", "StreamingLLMPress"}


# --- beam search --------------------------------------------------------------------------------------------
def teacher_forced_logprob(model, ids, mask, new_tokens) -> torch.Tensor:
    """Sum of log-probs of `new_tokens` `(rows, n)` after the prompt, fed one by one (inside the press)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask, position_ids=positions)
    total = torch.zeros(ids.shape[0], dtype=torch.float64, device=ids.device)
    for t in range(new_tokens.shape[1]):
        token = new_tokens[:, t : t + 1]
        total += out.logits[:, -1].double().log_softmax(-1).gather(-1, token)[:, 0]
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1, cache=out.cache)
    return total


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_beam_scores_are_the_teacher_forced_logprobs(arch, impl, press_cls):
    """Every returned beam's score is the log-prob of its tokens under the same press: the cache (and all press
    state) followed each beam through every reorder."""
    model = make_model(arch, impl)
    if impl == "sdpa":  # float64; transformers' eager attention gives NaN on a left-padded row in float64, press or not
        model = model.double()
    ids, mask = padded_batch()
    new = 6
    press = tiny_press(press_cls)
    with press(model):
        for beams, returns, sample in [(2, 1, False), (4, 2, False), (2, 2, True)]:
            torch.manual_seed(0)
            out = model.generate(ids, attention_mask=mask, num_beams=beams, num_return_sequences=returns,
                                 do_sample=sample, max_new_tokens=new, length_penalty=0.0, suppress_tokens=[2],
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            rows, row_mask = ids.repeat_interleave(returns, 0), mask.repeat_interleave(returns, 0)
            expected = teacher_forced_logprob(model, rows, row_mask, out.sequences[:, ids.shape[1]:])
            gap = (out.sequences_scores.double() - expected).abs().max()
            assert gap < 1e-3, f"{beams} beams, {returns} returned, sample={sample}: gap {gap:.2e}"


# --- threads ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_concurrent_generations_on_one_model_give_the_sequential_outputs(press_cls):
    model = make_model("llama")
    prompts = [prompt(64 + 8 * i, seed=i) for i in range(4)]
    with tiny_press(press_cls)(model):
        expected = [greedy(model, p, new=8) for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            for _ in range(20):
                for got, want in zip(pool.map(lambda p: greedy(model, p, new=8), prompts), expected):
                    assert torch.equal(got, want)


def held(model, press) -> tuple:
    """What a generation could leave behind outside its cache: the press's fields and the attributes of every
    module of the model (each value's identity; a press's options by their repr, so a list filled in place shows),
    and the model's config."""
    modules = {name: {key: id(value) for key, value in vars(module).items()} for name, module in model.named_modules()}
    hooks = {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()}
    fields = {key: (id(value), repr(value)) for key, value in vars(press).items()}
    return fields, modules, hooks, model.config.to_dict()


@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_a_generation_leaves_the_press_and_the_model_as_they_were(press_cls):
    """Per-generation state lives in the cache, its layers and the forward under way: generating (a padded batch,
    greedy and with beams) writes nothing on the press or on any module of the model, where another generation
    would meet it."""
    model = make_model("llama")
    press = tiny_press(press_cls)
    ids, mask = padded_batch()
    before = held(model, press)
    with press(model):
        greedy(model, ids, mask, new=6)
        greedy(model, ids, mask, new=4, num_beams=2)
    fields, modules, hooks, config = held(model, press)
    assert fields == before[0], f"{press_cls.__name__} changed its fields while generating"
    changed = {name for name in modules if modules[name] != before[1].get(name)}
    assert not changed, f"generating under {press_cls.__name__} set attributes on modules {sorted(changed)}"
    assert hooks == before[2] and config == before[3]


def test_different_presses_on_different_models_in_parallel():
    models = [make_model("llama", seed=s) for s in range(len(PRESSES))]
    ids = prompt(64)
    expected = []
    for model, cls in zip(models, PRESSES):
        with tiny_press(cls)(model):
            expected.append(greedy(model, ids, new=8))
    barrier = threading.Barrier(len(PRESSES))

    def run(i):
        with tiny_press(PRESSES[i])(models[i]):
            barrier.wait()
            return [greedy(models[i], ids, new=8) for _ in range(5)]

    with ThreadPoolExecutor(len(PRESSES)) as pool:
        for outs, want in zip(pool.map(run, range(len(PRESSES))), expected):
            assert all(torch.equal(o, want) for o in outs)


# --- drafts: prompt lookup and assisted decoding (crop) ----------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant"])
@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_drafted_decoding(arch, mode, press_cls):
    """Presses that compress the prompt only decode exactly as greedy; the others never hold more than greedy
    (a press that cuts every `k` steps: than greedy may hold between two cuts, `k - 1` tokens more)."""
    model = make_model(arch).double()
    base = prompt(40, seed=5)
    ids = torch.cat([base, base[:, :30]], dim=1)  # repeats: prompt lookup finds drafts
    draft = ({"prompt_lookup_num_tokens": 3} if mode == "prompt_lookup"
             else {"assistant_model": make_model(arch, seed=1).double()})
    press = tiny_press(press_cls)
    with press(model):
        plain = greedy(model, ids, new=16, return_dict_in_generate=True)
        drafted = greedy(model, ids, new=16, return_dict_in_generate=True, **draft)
    assert drafted.sequences.shape == plain.sequences.shape
    assert drafted.cache.get_seq_length() == plain.cache.get_seq_length()
    if not acts_while_decoding(press_cls):
        assert torch.equal(drafted.sequences, plain.sequences)
    held, greedy_held = drafted.cache.stats().resident_tokens, plain.cache.stats().resident_tokens
    slack = (press.eviction_interval() or 1) - 1
    assert all(h <= g + slack for h, g in zip(held, greedy_held))


@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_crop_forgets_the_rejected_tokens(press_cls):
    """Prompt, a 3-token forward, crop 2: the KV and the press state are those of prompt + the kept token."""
    model = make_model("llama").double()
    ids, extra = prompt(64), prompt(3, seed=9)
    sentence = issubclass(press_cls, SentencePress)
    with tiny_press(press_cls)(model):
        cropped = model(ids).cache
        before = [s.clone() for s in query_sums(cropped)] if sentence else []
        model(extra, cache=cropped, logits_to_keep=3)  # a draft being verified, as generate asks for it
        kept = [q[:, :, :1] for q in step_queries(cropped)] if sentence else []
        cropped.crop(-2)
        direct = model(ids).cache
        model(extra[:, :1], cache=direct)
    assert cropped.get_seq_length() == direct.get_seq_length() == 65
    for a, b in zip(cropped.compressed_layers(), direct.compressed_layers()):
        assert a.slots <= b.slots or acts_while_decoding(press_cls)
        held = lambda layer: {int(p) for p in layer.positions[0, 0][layer.valid[0, 0]]}  # noqa: E731
        assert max(held(a)) == 64 and not any(p > 64 for p in held(a))
        if not acts_while_decoding(press_cls):
            assert torch.equal(a.positions, b.positions) and torch.allclose(a.keys, b.keys)
    if isinstance(cropped.state, sparsekv.presses.chess.CHESSState):
        torch.testing.assert_close(cropped.state.page_sums, direct.state.page_sums)
    if sentence:
        # The mean query keeps the kept token's query and loses the rejected ones'. Layer 0's queries do not depend
        # on what attention read, so there it equals the direct forward's; a deeper layer's query of the kept token
        # does (the draft's selection was made with all three tokens' queries): there it is the draft forward's.
        torch.testing.assert_close(query_sums(cropped)[0], query_sums(direct)[0])
        ends = closes_sentence(make_tokenizer(), extra[:, 0]).to(extra.device)[:, None, None, None]
        for total, sum_before, query in zip(query_sums(cropped), before, kept):
            torch.testing.assert_close(total, torch.where(ends, 0.0, sum_before + query))


def query_sums(cache) -> list[torch.Tensor]:
    """SentencePress's mean query sum of each compressed layer (each a slice of the stack of them)."""
    return [sum_ for stack in cache.state.stacks for sum_ in stack.query_sum.unbind(1)]


def step_queries(cache) -> list[torch.Tensor]:
    """SentencePress's queries of the last forward, per compressed layer."""
    return [query for stack in cache.state.stacks for query in stack.step_queries]


# --- a prompt in pieces (generate's prefill_chunk_size) ----------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_a_prompt_in_pieces_is_compressed_as_in_one_forward(press_cls, arch):
    """generate's chunked prefill: every press keeps the same tokens and answers as with the prompt in one
    forward, padded rows included, also when the last piece is shorter than SnapKV's window (99 tokens in pieces
    of 32: the last holds 3). It used to compress the first piece alone (SnapKV kept a quarter of it and every
    later token). One piece is a plain prompt. On every architecture (Gemma3's RoPE differs by layer type)."""
    model = make_model(arch).double()
    ids, mask = padded_batch(99)
    with tiny_press(press_cls)(model):
        whole = greedy(model, ids, mask, new=6, return_dict_in_generate=True)
        one = greedy(model, ids, mask, new=6, prefill_chunk_size=99, return_dict_in_generate=True)
        pieces = greedy(model, ids, mask, new=6, prefill_chunk_size=32, return_dict_in_generate=True)
    assert torch.equal(one.sequences, whole.sequences) and torch.equal(pieces.sequences, whole.sequences)
    assert pieces.cache.pieces is None
    for a, b in zip(pieces.cache.compressed_layers(), whole.cache.compressed_layers()):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.valid, b.valid)
    assert torch.equal(greedy(model, ids, mask, new=6, prefill_chunk_size=32), greedy(model, ids, mask, new=6))


@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_a_prompt_in_pieces_with_beams_and_prompt_lookup(press_cls):
    """Pieces combine with the other modes: beam search and prompt lookup give what they give in one forward."""
    model = make_model("llama").double()
    ids = torch.cat([prompt(80), prompt(10, seed=4).repeat(1, 2)], dim=1)  # a repeat for prompt lookup to find
    with tiny_press(press_cls)(model):
        for mode in ({"num_beams": 2}, {"prompt_lookup_num_tokens": 3}):
            pieces = greedy(model, ids, new=6, prefill_chunk_size=32, **mode)
            assert torch.equal(pieces, greedy(model, ids, new=6, **mode))


def test_pieces_are_read_from_generates_prefill_or_refused():
    """Which piece a forward is comes from generate's `_prefill` locals; a transformers that names them otherwise
    is refused rather than guessed, and no pieces (or one) means a plain prompt."""
    from sparsekv.generation import pieces_after

    snap, chunks = SnapKVPress(ratio=0.25), (torch.zeros(1, 32),) * 3
    config = GenerationConfig(prefill_chunk_size=32)
    assert pieces_after(snap, {}) == pieces_after(snap, {"generation_config": GenerationConfig()}) == 0
    assert pieces_after(snap, {"generation_config": config, "input_chunks": chunks[:1], "chunk_idx": 0}) == 0
    assert [pieces_after(snap, {"generation_config": config, "input_chunks": chunks, "chunk_idx": i})
            for i in range(3)] == [2, 1, 0]
    chess = CHESSPress(ratio=0.25)  # reads them itself
    assert pieces_after(chess, {"generation_config": config, "input_chunks": chunks, "chunk_idx": 0}) == 0
    for renamed in ({"input_chunks": chunks, "piece": 0}, {"pieces": chunks, "chunk_idx": 0}):
        with pytest.raises(ValueError, match="cannot tell which piece of the prompt this forward is"):
            pieces_after(snap, {"generation_config": config, **renamed})


def test_a_press_that_cannot_read_a_prompt_in_pieces_refuses_it():
    """A press that does not say what it reads of a prompt in pieces (`prompt_tail`) refuses one, naming the
    option, rather than compress the first piece alone; a prompt in one piece runs."""
    @dataclasses.dataclass(kw_only=True)
    class Oldest(ScorerPress):
        def score(self, ctx):
            return -ctx.positions.float()

    model = make_model("llama")
    with Oldest(ratio=0.25)(model):
        greedy(model, prompt(99), new=2, prefill_chunk_size=99)
        with pytest.raises(ValueError, match=r"Oldest cannot compress a prompt read in pieces, and generate's "
                                             r"prefill_chunk_size=32 splits this prompt into 4 forwards"):
            greedy(model, prompt(99), new=2, prefill_chunk_size=32)


def test_a_prompt_in_pieces_keeps_only_a_tail_of_layer_inputs():
    """While a prompt is read in pieces the cache keeps each layer's inputs for the last `prompt_tail` tokens
    only (SnapKV's window), not the prompt's activations, one RoPE table for every layer, and the layers hold
    every piece's KV uncompressed."""
    model = make_model("llama")
    ids = prompt(99)
    seen = []

    def watch(module, args, kwargs):
        cache = kwargs.get("cache")
        if isinstance(cache, SparseCache) and cache.pieces is not None and cache.pieces.inputs:
            seen.append(({t.shape[1] for t in cache.pieces.inputs.values()}, cache.pieces.rope[0].shape[1],
                         cache.layers[0].keys.shape[-2], cache.layers[0].compressed))

    hook = model.register_forward_pre_hook(watch, with_kwargs=True)
    try:
        with SnapKVPress(ratio=0.25, window_size=8)(model):
            greedy(model, ids, new=2, prefill_chunk_size=32)
    finally:
        hook.remove()
    assert seen == [({8}, 32, 32, False), ({8}, 64, 64, False), ({8}, 96, 96, False)]  # one RoPE table


# --- reset, batch selection and repetition, copies ---------------------------------------------------------------
@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_reset_then_reuse_equals_a_fresh_cache(press_cls):
    model = make_model("llama")
    first, second = prompt(80, seed=1), prompt(64, seed=2)
    with tiny_press(press_cls)(model):
        cache = greedy(model, first, new=6, return_dict_in_generate=True).cache
        cache.reset()
        reused = greedy(model, second, new=8, cache=cache)
        fresh = greedy(model, second, new=8)
    assert torch.equal(reused, fresh)


@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
@torch.no_grad()
def test_batch_select_and_repeat_follow_every_row(press_cls):
    model = make_model("llama")
    ids, mask = padded_batch()
    token = prompt(1, batch=2, seed=4)
    step_mask = torch.cat([mask, torch.ones_like(token)], 1)
    with tiny_press(press_cls)(model):
        cache = model(ids, attention_mask=mask).cache
        both = model(token, attention_mask=step_mask, cache=copy.deepcopy(cache)).logits[:, -1]
        second = copy.deepcopy(cache)
        second.batch_select_indices(torch.tensor([1]))
        doubled = copy.deepcopy(second)
        doubled.batch_repeat_interleave(2)
        alone = model(token[1:], attention_mask=step_mask[1:], cache=second).logits[:, -1]
        again = model(token[1:].repeat(2, 1), attention_mask=step_mask[1:].repeat(2, 1),
                      cache=doubled).logits[:, -1]
    torch.testing.assert_close(alone[0], both[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, torch.cat([alone, alone]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("save", ["pickle", "torch.save"])
def test_a_saved_cache_continues_as_the_original(press_cls, save):
    """A left-padded batch decoded past its budget (H2O and StreamingLLM evicting at every step), saved, loaded
    and continued: the tokens the original cache continues with. (Plain pickle saved the views an evicting
    layer's steps write through as copies of their own: the loaded cache decoded other tokens.)"""
    model = make_model("llama")
    ids, mask = padded_batch()
    with tiny_press(press_cls)(model):
        out = greedy(model, ids, mask, new=20, return_dict_in_generate=True)
        seq, mask = out.sequences, torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1]:])], 1)
        if save == "pickle":
            loaded = pickle.loads(pickle.dumps(out.cache))
        else:
            data = io.BytesIO()
            torch.save(out.cache, data)
            loaded = torch.load(io.BytesIO(data.getvalue()), weights_only=False)
        again = greedy(model, seq, mask, new=8, cache=loaded)
        original = greedy(model, seq, mask, new=8, cache=out.cache)
    assert torch.equal(again, original)


def test_state_that_is_not_batch_first_is_named():
    model = make_model("llama")
    with SnapKVPress(ratio=0.5, window_size=8)(model):
        cache = model(prompt(32, batch=2)).cache
    cache.layers[0].extra["oops"] = torch.zeros(3, 4)
    with pytest.raises(TypeError, match=r"KVLayer.extra\['oops'\] has shape \(3, 4\), not batch-first"):
        cache.reorder_cache(torch.tensor([1, 0]))


# --- outside the with block, and caches the press cannot use ------------------------------------------------------
@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_a_compressed_cache_used_without_its_press_raises(press_cls):
    model = make_model("llama")
    with tiny_press(press_cls)(model):
        cache = model(prompt(64)).cache
    with pytest.raises(RuntimeError, match=r"continue it inside `with press\(model\):`"):
        model(prompt(3, seed=1), cache=cache)
    with tiny_press(press_cls)(model):  # inside again: it continues
        assert model(prompt(3, seed=1), cache=cache).cache.get_seq_length() == 67


def test_use_cache_false_and_a_users_dynamic_cache_are_said(caplog):
    model = make_model("llama")
    ids = prompt(64)
    with caplog.at_level(logging.WARNING, logger="sparsekv"), SnapKVPress(ratio=0.25, window_size=8)(model):
        greedy(model, ids, new=3, use_cache=False)
        out = greedy(model, ids, new=3, cache=DynamicCache(config=model.config), return_dict_in_generate=True)
    messages = [r.getMessage() for r in caplog.records if r.name == "sparsekv"]
    assert len(messages) == 2  # once each, not once per forward
    assert "use_cache=False" in messages[0] and "does nothing" in messages[0]
    assert "DynamicCache it did not build" in messages[1] and "press.make_cache(model)" in messages[1]
    assert not isinstance(out.cache, SparseCache) and out.cache.get_seq_length() == 66  # uncompressed


def test_output_attentions_over_slots_is_said(caplog):
    """A compressed layer's attention weights cover its slots, not every position: said once per block, and the
    slots' positions say what each weight is over."""
    model = make_model("llama", "eager")
    with caplog.at_level(logging.WARNING, logger="sparsekv"), SnapKVPress(ratio=0.25, window_size=8)(model):
        out = greedy(model, prompt(64), new=3, output_attentions=True, return_dict_in_generate=True)
        greedy(model, prompt(64), new=3, output_attentions=True)
    messages = [r.getMessage() for r in caplog.records if r.name == "sparsekv"]
    assert len(messages) == 1 and "output_attentions" in messages[0] and "positions" in messages[0]
    step = out.attentions[-1][0]  # the last step's, layer 0: over the 16 kept slots and the steps' tokens
    assert step.shape[-1] == out.cache.layers[0].positions.shape[-1] == 16 + 2


@pytest.mark.parametrize("implementation", ["static", "offloaded"])
def test_caches_a_press_cannot_compress_are_refused(implementation):
    model = make_model("llama")
    with SnapKVPress(ratio=0.25, window_size=8)(model), pytest.raises(ValueError, match="cannot compress a"):
        greedy(model, prompt(64), new=3, cache_implementation=implementation)


# --- the core's invariants -------------------------------------------------------------------------------------------
def test_capabilities_follow_the_overrides():
    """The phases a press overrides are the ones the driver calls; a hand-made flag that disagrees is refused,
    naming the one to use."""
    class Selects(Press):
        def choose(self, ctx):
            return None

    class Reads(Press):
        def on_queries(self, ctx):
            pass

    class Captures(Press):
        captures_step_queries: ClassVar[bool] = True

    assert Selects.selects_before_attention and not Selects.reads_step_queries and not Selects.captures_step_queries
    assert Reads.reads_step_queries and Reads.captures_step_queries and not Reads.selects_before_attention
    assert Captures.captures_step_queries and not Captures.reads_step_queries
    assert not Press.selects_before_attention and not Press.reads_step_queries
    with pytest.raises(TypeError, match="declare captures_step_queries = True"):
        class Old(Press):
            reads_step_queries: ClassVar[bool] = True


def test_query_time_selection_may_not_change_the_layout():
    @dataclasses.dataclass(kw_only=True)
    class Shrinks(SnapKVPress):
        def on_queries(self, ctx):
            layer = ctx.layer
            layer.select(torch.zeros(*layer.positions.shape[:2], 3, dtype=torch.long, device=layer.positions.device),
                         torch.ones(layer.valid.shape[0], 3, dtype=torch.bool, device=layer.valid.device))

    @dataclasses.dataclass(kw_only=True)
    class Revalidates(SnapKVPress):  # as many slots, a new validity
        def on_queries(self, ctx):
            layer = ctx.layer
            idx = torch.arange(layer.slots, device=layer.positions.device).expand(*layer.positions.shape[:2], -1)
            layer.select(idx, layer.valid.clone())

    model = make_model("llama")
    for press in (Shrinks(ratio=0.5, window_size=8), Revalidates(ratio=0.5, window_size=8)):
        with press(model), pytest.raises(RuntimeError, match="after its mask was built"):
            greedy(model, prompt(32), new=3)


# --- configuration ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_numpy_scalars_are_accepted_and_booleans_refused(press_cls):
    press = tiny_press(press_cls, ratio=np.float32(0.25))
    assert press.ratio == 0.25 and type(press.ratio) is float
    with pytest.raises(ValueError, match="ratio must be in"):
        tiny_press(press_cls, ratio=True)
    if "budget" not in getattr(press_cls, "budget_options", ()) and press_cls is not CHESSPress:
        assert tiny_press(press_cls, budget=np.int64(20)).budget == 20
        with pytest.raises(ValueError, match="budget must be an integer"):
            tiny_press(press_cls, budget=True)


@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_dataclasses_replace_works(press_cls):
    press = tiny_press(press_cls)
    changed = dataclasses.replace(press, ratio=0.5)
    assert changed.ratio == 0.5 and dataclasses.replace(press) == press


def test_store_layers_are_core_layers():
    """CHESS and SentenceKV keep no layer class of their own: the core's store-backed layer serves both."""
    model = make_model("llama")
    for press in (tiny_press(CHESSPress), tiny_press(SentencePress)):
        with press(model):
            cache = model(prompt(64)).cache
        assert all(type(layer) is StoreLayer for layer in cache.layers)
