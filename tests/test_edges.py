"""At the edges, as a new user meets them: short prompts and rows kept whole, budgets for every press, right padding,
a cache under another press, threads, and the common slips, each refused with what to write instead."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch
from conftest import DEVICE, greedy, make_model, make_tokenizer, prompt
from test_core import hook_count, left_padded
from test_generate_modes import PRESSES, acts_while_decoding, tiny_press

import sparsekv
import sparsekv.log
from sparsekv import (
    CHESSPress,
    ChunkPress,
    H2OPress,
    SentencePress,
    SnapKVPress,
    StreamingLLMPress,
    make_press,
)
from sparsekv.presses.chess_levels import top_fraction

EVICTING = tuple(c for c in PRESSES if tiny_press(c).holds_budget_while_decoding())  # H2O, StreamingLLM, TOVA, ...
PER_STEP = tuple(c for c in EVICTING if tiny_press(c).eviction_interval() is None)  # (DecodingPress cuts every k steps)


@pytest.fixture
def said(caplog):
    """The `sparsekv` warnings of the test, with the once-per-process messages forgotten before it."""
    sparsekv.log._said.clear()
    with caplog.at_level(logging.WARNING, logger="sparsekv"):
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "sparsekv"]
    sparsekv.log._said.clear()


def real_held(cache) -> list[list[int]]:
    """Per compressed layer, the real tokens each row holds."""
    return [layer.valid[:, 0].sum(-1).tolist() for layer in cache.compressed_layers()]


# --- short prompts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_a_prompt_shorter_than_what_the_press_keeps_is_kept_whole(press_cls, said):
    """"Hi" in a chat app: 6 tokens, fewer than the press always keeps (SnapKV's window, SentenceKV's sinks and
    window, a page of CHESS). The prompt is kept whole and the output is the uncompressed one, token for token, or
    (H2O, StreamingLLM) the budget is held while decoding. Said once, however many generations."""
    model = make_model("llama")
    ids = prompt(6)
    plain = greedy(model, ids, new=12)
    with tiny_press(press_cls)(model):
        out = greedy(model, ids, new=12, return_dict_in_generate=True)
        again = greedy(model, prompt(5, seed=2), new=4)
    assert again.shape == (1, 9)
    if press_cls in EVICTING:
        budget = int(out.cache.budgets[0])
        assert all(held == [budget] for held in real_held(out.cache))
    else:
        assert torch.equal(out.sequences, plain)
    if press_cls is not CHESSPress:  # CHESS selects pages: no budget
        messages = said()
        assert len(messages) == 1 and "whole" in messages[0] and press_cls.__name__ in messages[0], messages


@pytest.mark.parametrize("press_cls", PER_STEP, ids=lambda c: c.__name__)
def test_a_chat_turn_under_the_floor_decodes_untouched_at_defaults(press_cls, said):
    """H2O and StreamingLLM never hold fewer than their floor (64 tokens at their defaults: a recent window, and
    StreamingLLM's sinks), so a prompt and its answer that fit in it decode as the plain model does, alone and
    in a left-padded batch; past the floor they hold it. Said once, naming the floor."""
    model = make_model("llama")
    floor, _ = press_cls(ratio=0.1).min_kept()
    assert floor == 64
    ids, mask = left_padded((40, 20), 40)
    with press_cls(ratio=0.1)(model):
        batch = greedy(model, ids, mask, new=24, suppress_tokens=[2])  # 64 and 44 tokens: within the floor
        longer = greedy(model, ids[:1], new=40, suppress_tokens=[2], return_dict_in_generate=True)
    for row, n in enumerate((40, 20)):
        plain = greedy(model, ids[row:row + 1, 40 - n:], new=24, suppress_tokens=[2])
        assert torch.equal(batch[row, 40:], plain[0, n:]), f"row {row}"
    assert all(held == [floor] for held in real_held(longer.cache))  # 40 + 39 tokens seen, the floor held
    messages = said()
    assert len(messages) == 1 and "kept whole" in messages[0] and "grows to 64 tokens" in messages[0], messages


@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_a_short_row_beside_long_ones_is_served_as_alone(press_cls):
    """One short row no longer fails the batch: each row of a padded batch decodes as it does alone under the
    press (the short one kept whole, the long one compressed)."""
    model = make_model("llama")
    ids, mask = left_padded((70, 5), 70)
    with tiny_press(press_cls)(model):
        batch = greedy(model, ids, mask, new=8)
        for row, n in enumerate((70, 5)):
            alone = greedy(model, ids[row:row + 1, 70 - n:], new=8)
            assert torch.equal(batch[row, 70:], alone[0, n:]), f"row {row}"
    plain = greedy(model, ids[1:, 65:], new=8)
    if not acts_while_decoding(press_cls):
        assert torch.equal(batch[1, 70:], plain[0, 5:])  # kept whole


@pytest.mark.parametrize("press_cls", [c for c in PRESSES if c not in EVICTING], ids=lambda c: c.__name__)
def test_a_budget_larger_than_the_prompt_keeps_it_whole(press_cls):
    model = make_model("llama")
    ids = prompt(60)
    with tiny_press(press_cls, budget=64)(model):
        out = greedy(model, ids, new=10)
    assert torch.equal(out, greedy(model, ids, new=10))


@pytest.mark.parametrize("press_cls", EVICTING)
@pytest.mark.parametrize("lengths", [(60,), (70, 30)])
def test_an_evicting_press_holds_a_budget_larger_than_the_prompt_once_decoding_reaches_it(press_cls, lengths):
    """budget=50: a row of 60 tokens is cut to 50; a row of 30 is kept whole and grows to 50 while decoding, then
    evicts, in a batch (its filler slots take the new tokens) as alone."""
    model = make_model("llama")
    width = max(lengths)
    ids, mask = left_padded(lengths, width)
    press = tiny_press(press_cls, budget=50)
    with press(model):
        out = greedy(model, ids, mask, new=30, return_dict_in_generate=True, suppress_tokens=[2])
        for row, n in enumerate(lengths):
            alone = greedy(model, ids[row:row + 1, width - n:], new=30, suppress_tokens=[2])
            assert torch.equal(out.sequences[row, width:], alone[0, n:]), f"row {row}"
    slack = (press.eviction_interval() or 1) - 1  # (a press cutting every k steps holds k - 1 more between cuts)
    assert all(all(50 <= h <= 50 + slack for h in held) for held in real_held(out.cache))
    # Before decoding reaches the budget, a row kept whole holds everything it has seen.
    with press(model):
        short = greedy(model, prompt(30), new=10, return_dict_in_generate=True)
    assert all(held == [39] for held in real_held(short.cache))


def test_ratio_on_a_short_prompt_keeps_at_least_what_the_press_always_keeps(said):
    """ratio=0.1 of a 100-token prompt is 10 tokens, fewer than SnapKV's 32-token window: it keeps the window,
    and says so once."""
    model = make_model("llama")
    with SnapKVPress(ratio=0.1)(model):
        cache = model(prompt(100)).cache
        model(prompt(90))
    assert int(cache.budgets[0]) == 32
    assert all(layer.slots == 32 for layer in cache.compressed_layers())
    assert said() == ["sparsekv: SnapKVPress: ratio=0.1 of a prompt of 100 tokens is 10 tokens, under the press's "
                      "floor (window_size=32): it keeps 32. (Said once.)"]


# --- a budget for CHESS ----------------------------------------------------------------------------------------------
def test_chess_budget_is_the_tokens_a_step_attends():
    model = make_model("llama")
    ids = prompt(400)
    with CHESSPress(read_budget=96, page_size=8, reselect="always")(model):
        out = greedy(model, ids, new=6, return_dict_in_generate=True)
    attended = out.cache.stats().attended_tokens
    assert all(64 <= a <= 96 + 8 + 6 for a in attended), attended  # within a page and the steps since
    with CHESSPress(read_budget=500, page_size=8, reselect="always")(model):
        whole = greedy(model, ids, new=6, return_dict_in_generate=True)
    assert torch.equal(whole.sequences, greedy(model, ids, new=6))


def test_a_fraction_per_row_selects_as_the_quantile_does():
    """CHESS's budget gives each row its own fraction; rows given the same one select what one fraction selects."""
    g = torch.Generator().manual_seed(0)
    scores, active = torch.randn(3, 40, generator=g), torch.rand(3, 40, generator=g) > 0.3
    for rho in (0.05, 0.2, 0.5, 0.9, 1.0):
        assert torch.equal(top_fraction(scores, active, torch.full((3,), rho, dtype=torch.float64)),
                           top_fraction(scores, active, rho))


# --- padding on the right ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_right_padding_is_refused_naming_the_fix(press_cls):
    model = make_model("llama")
    ids, mask = left_padded((40, 32), 40)
    ids, mask = ids.flip(1), mask.flip(1)  # padded on the right
    hooks = hook_count(model)
    with tiny_press(press_cls)(model), pytest.raises(ValueError, match=r"row 1 has padding after its first real "
                                                                      r"token .*tokenizer.padding_side = \"left\""):
        greedy(model, ids, mask, new=3)
    assert hook_count(model) == hooks


@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_a_row_of_only_padding_is_refused_naming_the_row(press_cls):
    """A row with no real token has no budget to keep: refused at the door, naming the row, whether the batch is
    prefilled together, in pieces, or a row at a time (there a row needs a real token before its last)."""
    model = make_model("llama")
    ids, mask = left_padded((40, 1, 32), 40)
    with tiny_press(press_cls)(model):
        for kwargs in ({}, {"prefill_chunk_size": 16}):
            masked = mask.clone()
            masked[1] = 0
            with pytest.raises(ValueError, match=r"row 1 of the batch is only padding \(no real token\)"):
                greedy(model, ids, masked, new=3, **kwargs)
        with pytest.raises(ValueError, match=r"row 1 has fewer than 2 real tokens, and prefill_rows holds"):
            sparsekv.prefill_rows(model, ids, mask)


# --- a cache under another press, threads -----------------------------------------------------------------------------
def test_a_cache_continued_under_another_press_is_refused_naming_both():
    model = make_model("llama")
    first, second = SnapKVPress(ratio=0.5, window_size=8), H2OPress(ratio=0.5, window_size=1)
    with first(model):
        cache = model(prompt(40)).cache
    with second(model), pytest.raises(ValueError, match=r"built under SnapKVPress\(ratio=0.5.*this block installs "
                                                        r"H2OPress\(ratio=0.5"):
        model(prompt(3, seed=1), cache=cache)
    with dataclasses.replace(first)(model):  # the same press, another object: it continues
        assert model(prompt(3, seed=1), cache=cache).cache.get_seq_length() == 43


def test_a_press_applies_to_every_caller_of_the_model_while_its_block_is_open():
    """What the README says: `with press(model):` hooks the model itself, so a generation another thread starts on
    it meanwhile is compressed too, and after the block none is."""
    model = make_model("llama")
    ids = prompt(64)
    press = SnapKVPress(ratio=0.25, window_size=8)
    plain = greedy(model, ids)
    with press(model):
        pressed = greedy(model, ids)
    assert not torch.equal(plain, pressed)
    inside, done = threading.Event(), threading.Event()
    got = {}

    def other_thread():
        inside.wait()
        got["out"] = greedy(model, ids)  # a plain call, no press of its own
        done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with press(model):
        inside.set()
        done.wait()
    worker.join()
    assert torch.equal(got["out"], pressed)
    assert torch.equal(greedy(model, ids), plain)


# --- the common slips, refused with what to write ---------------------------------------------------------------------
@pytest.mark.parametrize("make, error, message", [
    (lambda: ChunkPress(0.1), TypeError, r"ChunkPress takes its options by keyword: ChunkPress\(ratio=0.1\)"),
    (lambda: SnapKVPress(compression_ratio=0.3), TypeError,
     r"compression_ratio is the fraction of the KV cache removed.*ratio = 1 - compression_ratio \(here ratio=0.7\)"),
    (lambda: StreamingLLMPress(ratio=0.1, n_sink=4), TypeError, "unknown option n_sink=4: sparsekv spells it n_sinks"),
    (lambda: ChunkPress(ratio=0.1, chunk_length=8), TypeError, "sparsekv spells it chunk_size"),
    (lambda: SnapKVPress(ratio=0.1, windw_size=8), TypeError, r"did you mean window_size\? Its options: budget, "),
    (lambda: SentencePress(make_tokenizer(), 0.1), TypeError, r"SentencePress\(tokenizer, ratio=0.1\)"),
    (lambda: SentencePress(make_tokenizer(), ratio=0.1, plan="layer"), TypeError,
     "unknown option plan='layer': it is called rank_at now"),
    (lambda: make_press("sentencekv:rank_at=sometimes", tokenizer=make_tokenizer()), ValueError,
     "rank_at must be 'layer'"),
    (lambda: make_press(None), TypeError, "spec: a press spec is a string.* got NoneType None"),
    (lambda: make_press(123), TypeError, "spec: a press spec is a string.* got int 123"),
    (lambda: make_press(b"snapkv:ratio=0.1"), TypeError, "got bytes"),
    (lambda: make_press("chess:preset=aggressive,ratio=0.5"), ValueError, "got preset and ratio"),
])
def test_common_slips_name_the_fix(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_a_spec_that_sets_its_own_budget_replaces_a_sweeps_ratio():
    assert make_press("chess:preset=aggressive", ratio=0.5).preset == "aggressive"
    assert make_press("snapkv:budget=64", ratio=0.5).budget == 64


def test_a_press_used_as_a_context_manager_without_the_model_says_how():
    with pytest.raises(TypeError, match=r"with ChunkPress\(\.\.\.\)\(model\):"):
        with ChunkPress(ratio=0.1):
            pass
    with pytest.raises(TypeError, match="model must be a transformers model"):
        with ChunkPress(ratio=0.1)("llama"):
            pass


@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_bad_prompts_are_refused_naming_input_ids(press_cls):
    model = make_model("llama")
    with tiny_press(press_cls)(model):
        with pytest.raises(ValueError, match="input_ids: the prompt is empty"):
            model(torch.zeros(1, 0, dtype=torch.long, device=DEVICE))
        with pytest.raises(ValueError, match="input_ids: token ids must be integers"):
            model(prompt(40).float())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_offload_device_this_machine_lacks_is_refused_at_construction():
    with pytest.raises(ValueError, match="offload_device='cuda' is not available here"):
        SentencePress(make_tokenizer(), budget=64, offload_device="cuda")
