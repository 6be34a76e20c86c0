"""Rows prefilled apart and joined (`prefill_rows`, `SparseCache.join`): the batch a prefill together would give."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import byte_tokenizer, make_model, make_tokenizer, prompt

from sparsekv import (
    AdaKVPress, CHESSPress, ChunkPress, H2OPress, KVzipPress, RowState, SentencePress, SnapKVPress,
    SparseCache, StreamingLLMPress, prefill_rows,
)

JOINING = [SnapKVPress(ratio=0.3, window_size=8), H2OPress(ratio=0.3, window_size=1),
           StreamingLLMPress(ratio=0.3, window_size=1),
           ChunkPress(ratio=0.3, window_size=8, chunk_size=5),
           SentencePress(make_tokenizer(), ratio=0.3, n_sinks=4, window_size=8),  # (stores of 72 / 68 / 54 slots)
           # (stores with empty slots: keep_factor x tau is more than a row has besides its sinks and window)
           SentencePress(make_tokenizer(), ratio=0.47, n_sinks=4, window_size=8, rank_at="layer"),
           # (head-wise budgets: each row's heads in lanes)
           AdaKVPress(SnapKVPress(ratio=0.3, window_size=8)), KVzipPress(byte_tokenizer(), ratio=0.3, min_budget=8)]


def batch(length: int = 120) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of one padded length: one whole, two left-padded by 7 and 30 tokens (smaller budgets)."""
    ids = prompt(length, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :30] = 0
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Positions as generate gives them: from each row's first real token."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def together(model, press, ids, mask, **generate):
    """The batch prefilled together on all but the last token, then generated from: the reference, and the
    prompt's cache before decoding (a copy)."""
    with press(model), torch.no_grad():
        cache = model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions(mask[:, :-1]),
                      use_cache=True).cache
        prefilled = copy.deepcopy(cache)
        out = model.generate(ids, attention_mask=mask, cache=cache, **generate)
    return out, prefilled


@pytest.mark.parametrize("arch,impl", [("llama", "sdpa"), ("gemma3", "eager"), ("qwen2", "sdpa")])
@pytest.mark.parametrize("press", JOINING,
                         ids=lambda p: type(p).__name__ + getattr(p, "rank_at", "").replace("step", ""))
def test_rows_prefilled_apart_generate_what_the_batch_does(arch, impl, press):
    """Same kept prompt tokens per row and head, same budgets, same greedy tokens (evictions while decoding
    included) as the batch prefilled together; Gemma3's sliding layers joined too."""
    model = make_model(arch, impl)
    ids, mask = batch()
    reference, cache = together(model, press, ids, mask, max_new_tokens=8, do_sample=False)
    with press(model):
        joined = prefill_rows(model, ids, mask)
        assert joined.get_seq_length() == ids.shape[1] - 1
        torch.testing.assert_close(joined.budgets, cache.budgets)
        kept, expected = joined.prompt_kept(), cache.prompt_kept()
        for mine, theirs in zip(joined.compressed_layers(), cache.compressed_layers()):
            assert mine.slots == theirs.slots and torch.equal(mine.valid, theirs.valid)
            assert getattr(mine, "loaded", 0) == getattr(theirs, "loaded", 0)  # SentenceKV's loaded region
        # The press's state (SentenceKV's): its counts and indices laid out as the batch's (sentences, store slots,
        # the loaded region; a vector of an empty sentence may differ: it is never loaded)
        _assert_laid_out_alike(joined.state, cache.state, "state")
        out = model.generate(ids, attention_mask=mask, cache=joined, max_new_tokens=8, do_sample=False)
        decoded, decoded_expected = joined.prompt_kept(), cache.prompt_kept()
    assert kept.keys() == expected.keys()
    for layer in kept:
        assert torch.equal(kept[layer], expected[layer])
    assert torch.equal(out, reference)
    if isinstance(press, (H2OPress, StreamingLLMPress)):  # they evicted prompt tokens while decoding, alike
        assert any(not torch.equal(decoded[i], kept[i]) for i in kept)


def _assert_laid_out_alike(mine, theirs, where: str) -> None:
    """Every integer and boolean tensor (and every other value) of a state equal, recursively; float ones skipped."""
    if isinstance(theirs, torch.Tensor):
        assert theirs.is_floating_point() or torch.equal(mine, theirs), where
    elif isinstance(theirs, RowState):
        for name, value in vars(theirs).items():
            _assert_laid_out_alike(vars(mine)[name], value, f"{where}.{name}")
    elif isinstance(theirs, (list, tuple, dict)):
        assert len(mine) == len(theirs), where
        for key in (theirs if isinstance(theirs, dict) else range(len(theirs))):
            _assert_laid_out_alike(mine[key], theirs[key], f"{where}[{key!r}]")
    else:
        assert mine == theirs, where


@pytest.mark.parametrize("press", [H2OPress(ratio=0.3, window_size=1), JOINING[4]], ids=lambda p: type(p).__name__)
def test_groups_of_rows_and_beam_search(press):
    """Rows prefilled two at a time join as well, and beam search (which reorders the joined rows) gives what it
    gives on the batch prefilled together. A cache given to generate is not expanded for its beams: say so."""
    model = make_model("llama")
    ids, mask = batch()
    settings = dict(max_new_tokens=6, do_sample=False, num_beams=2)
    with press(model), torch.no_grad():
        cache = model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions(mask[:, :-1]),
                      use_cache=True).cache
        with pytest.raises(ValueError, match=r"holds 3 rows and this forward has 6.*batch_repeat_interleave"):
            model.generate(ids, attention_mask=mask, cache=cache, **settings)
        cache = model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions(mask[:, :-1]),
                      use_cache=True).cache
        cache.batch_repeat_interleave(2)
        reference = model.generate(ids, attention_mask=mask, cache=cache, **settings)
        joined = prefill_rows(model, ids, mask, rows_at_once=2)
        joined.batch_repeat_interleave(2)
        out = model.generate(ids, attention_mask=mask, cache=joined, **settings)
    assert torch.equal(out, reference)


def test_join_pads_fewer_slots_with_fillers_first_and_leaves_its_caches():
    """A row holding fewer slots gets invalid fillers first; the joined cache holds exactly the batch's KV, and
    decoding it leaves the joined caches as they were."""
    model = make_model("llama")
    ids, mask = batch()
    press = SnapKVPress(ratio=0.3, window_size=8)
    _, cache = together(model, press, ids, mask, max_new_tokens=1)
    with press(model), torch.no_grad():
        parts = [model(ids[i:i + 1, :-1], attention_mask=mask[i:i + 1, :-1], use_cache=True,
                       position_ids=positions(mask[i:i + 1, :-1])).cache for i in range(3)]
        before = [copy.deepcopy(part) for part in parts]
        joined = SparseCache.join(parts)
        layer = joined.compressed_layers()[0]
        slots = [part.compressed_layers()[0].slots for part in parts]
        assert layer.slots == max(slots) > min(slots)
        for row, n in enumerate(slots):
            assert not layer.valid[row, :, : layer.slots - n].any() and layer.valid[row, :, layer.slots - n:].all()
        model.generate(ids, attention_mask=mask, cache=joined, max_new_tokens=4, do_sample=False)
    for part, old in zip(parts, before):
        for a, b in zip(part.compressed_layers(), old.compressed_layers()):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.positions, b.positions)
            assert a.logical_len == b.logical_len


def test_the_full_cache_prefilled_apart():
    """Without a press, the rows' full caches are joined: the same tokens as the batch prefilled together."""
    model = make_model("gemma3", "sdpa")
    ids, mask = batch()
    with torch.no_grad():
        cache = model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions(mask[:, :-1]),
                      use_cache=True).cache
    joined = prefill_rows(model, ids, mask)
    assert type(joined) is type(cache) and joined.get_seq_length() == ids.shape[1] - 1
    for a, b in zip(joined.layers, cache.layers):  # (Gemma3's first is a sliding window)
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    reference = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False)
    out = model.generate(ids, attention_mask=mask, cache=joined, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, reference)


def test_join_refusals():
    model = make_model("llama")
    ids, mask = batch()
    chess = CHESSPress(ratio=0.3, page_size=16)
    with chess(model), pytest.raises(ValueError, match="CHESSPress: cannot join caches"):
        prefill_rows(model, ids, mask)
    with chess(model), torch.no_grad():  # its layers too: a store that records every token is laid out by position
        parts = [model(ids[i:i + 1, :-1], use_cache=True).cache.compressed_layers()[0] for i in range(2)]
    with pytest.raises(ValueError, match="whose store records every token"):
        type(parts[0]).joined(parts)
    # SentenceKV keeps a prompt whole when it attends every token anyway: a short row alone, not in a batch
    short = mask.clone()
    short[1, :100] = 0
    sentences = SentencePress(make_tokenizer(), ratio=0.85, n_sinks=4, window_size=8)
    with sentences(model), pytest.raises(ValueError, match=r"caches \[1\] \(in the order joined\) kept their prompts"):
        prefill_rows(model, ids[:2], short[:2])
    press = SnapKVPress(ratio=0.3, window_size=8)
    with press(model), torch.no_grad():
        with pytest.raises(ValueError, match="rows_at_once: an integer >= 1"):
            prefill_rows(model, ids, mask, rows_at_once=0)
        with pytest.raises(ValueError, match="at least 2 tokens"):
            prefill_rows(model, ids[:, :1])
        short = model(ids[:1, :-2], use_cache=True).cache
        whole = model(ids[:1, :-1], use_cache=True).cache
        with pytest.raises(ValueError, match="prompts of different lengths"):
            SparseCache.join([whole, short])
        with pytest.raises(ValueError, match="hold a whole prompt"):
            SparseCache.join([whole, press.make_cache(model)])
        with pytest.raises(ValueError, match="one or more sparsekv caches"):
            SparseCache.join([])
    other = H2OPress(ratio=0.3, window_size=1)
    with other(model), torch.no_grad():
        theirs = model(ids[:1, :-1], use_cache=True).cache
    with pytest.raises(ValueError, match="different presses"):
        SparseCache.join([whole, theirs])


def test_sentencekv_prompts_kept_whole_join_as_they_are():
    """Prompts SentenceKV would attend whole anyway keep no store, alone as in a batch: their rows join as they
    are, and generate what the batch does."""
    model = make_model("llama")
    ids, mask = batch()
    press = SentencePress(make_tokenizer(), ratio=0.95, n_sinks=4, window_size=8)
    reference, _ = together(model, press, ids, mask, max_new_tokens=6, do_sample=False)
    with press(model):
        joined = prefill_rows(model, ids, mask)
        layers = joined.compressed_layers()
        assert layers and all(layer.store_keys is None and layer.slots == ids.shape[1] - 1 for layer in layers)
        out = model.generate(ids, attention_mask=mask, cache=joined, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, reference)


class _Rows(RowState):
    def __init__(self, table, n_pages, extra):
        self.table, self.n_pages, self.extra = table, n_pages, extra


def test_row_state_join_names_what_cannot_be_joined():
    """Per-row tensors are concatenated (also in dicts and tuples); anything else must be equal, or the error
    names the attribute."""
    a = _Rows(torch.zeros(1, 3), 4, {"pair": (torch.ones(1, 2), torch.zeros(1))})
    b = _Rows(torch.ones(1, 3), 4, {"pair": (torch.zeros(1, 2), torch.ones(1))})
    joined = _Rows.joined([a, b])
    assert torch.equal(joined.table, torch.tensor([[0.0] * 3, [1.0] * 3]))
    assert torch.equal(joined.extra["pair"][1], torch.tensor([0.0, 1.0])) and joined.n_pages == 4
    with pytest.raises(ValueError, match=r"_Rows.table cannot be joined: its shapes differ"):
        _Rows.joined([a, _Rows(torch.zeros(1, 5), 4, b.extra)])
    with pytest.raises(ValueError, match=r"_Rows.n_pages cannot be joined: it differs"):
        _Rows.joined([a, _Rows(torch.zeros(1, 3), 5, b.extra)])


def test_a_consuming_join_releases_each_layer_and_joins_the_same():
    """`consume=True` (what `prefill_rows` does with its own caches): the same joined KV, and the caches' layers
    released, so the rows' KV is never held twice."""
    model = make_model("llama")
    ids, mask = batch()
    press = H2OPress(ratio=0.3, window_size=1)
    with press(model), torch.no_grad():
        parts = [model(ids[i:i + 1, :-1], attention_mask=mask[i:i + 1, :-1], use_cache=True).cache for i in range(3)]
        kept = SparseCache.join(parts).prompt_kept()
        consumed = SparseCache.join(parts, consume=True)
    assert all(layer is None for part in parts for layer in part.layers)
    for layer, positions in consumed.prompt_kept().items():
        assert torch.equal(positions, kept[layer])
