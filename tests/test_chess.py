"""CHESSPress: page vectors, Algorithm 1's hierarchy, the working context, uncertainty-triggered re-selection."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, greedy, make_model, make_tokenizer, prompt

from sparsekv import CHESSPress, StoreLayer, make_press
from sparsekv.presses.chess import PRESETS, uncertainty
from sparsekv.presses.chess_pages import pad_columns

B = 8  # page size of the tests


def selections(cache) -> int:
    """The selections a CHESS cache's rows made (their prompts' included)."""
    return cache.stats().counts["selections"]


def chess(**kw):
    return CHESSPress(**{"page_size": B, "page_stride": B, "chunk_pages": 2, "grid_chunks": 2, **kw})


def chess_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, StoreLayer)]


def decode(model, ids, steps, mask=None):
    """Prefill `ids` then `steps` greedy steps by hand; yields the cache after each forward."""
    mask = torch.ones_like(ids) if mask is None else mask
    out = model(ids, attention_mask=mask)
    cache = out.cache
    yield cache
    for _ in range(steps):
        token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(token, cache=cache, attention_mask=mask)
        yield cache


@pytest.mark.parametrize("pre_rope, schedule", [(True, {"reselect": "always"}), (False, {"reselect": "always"}),
                                               (True, {"reselect_every": 7})])
def test_page_vectors_equal_a_recomputation_after_many_steps(pre_rope, schedule):
    model = make_model("qwen2", "sdpa")
    n, steps = 75, 50  # pages fill and complete while decoding
    ids = torch.zeros(2, n, dtype=torch.long, device=DEVICE)
    mask = torch.zeros(2, n, dtype=torch.long, device=DEVICE)
    ids[0], mask[0] = prompt(n)[0], 1
    ids[1, 20:], mask[1, 20:] = prompt(n - 20, seed=1)[0], 1
    projected = {}  # layer -> k_proj outputs of every forward: the keys before RoPE

    def record(i, module, args, out):
        projected.setdefault(i, []).append(out)

    hooks = [layer.self_attn.k_proj.register_forward_hook(lambda m, a, o, i=i: record(i, m, a, o))
             for i, layer in enumerate(model.model.layers)]
    try:
        with chess(preset="aggressive", pre_rope=pre_rope, **schedule)(model):
            for cache in decode(model, ids, steps, mask):
                pass
    finally:
        for hook in hooks:
            hook.remove()
    total = n + steps  # every forward's keys are in the sums after it, whether it selected or not
    sums = cache.state.page_sums
    for row, start in enumerate([0, 20]):
        for i, layer in enumerate(cache.layers):
            if pre_rope:
                keys = torch.cat(projected[i], dim=1)[row, start:total]  # (tokens, heads * dim)
            else:
                keys = layer.store_keys[row, :, start:total].transpose(0, 1).flatten(1)
            expected = torch.stack([page.sum(0) for page in keys.split(B)])
            column = cache.state.columns[i] * keys.shape[1]
            got = sums[row, : len(expected), column: column + keys.shape[1]]
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            assert not sums[row, len(expected):].any()


def test_hierarchy_masks_obey_parents_and_fractions_match_the_ratios():
    press = CHESSPress(ratios=(0.5, 0.4, 0.3), page_size=4, page_stride=4, chunk_pages=3, grid_chunks=4, sink_pages=1,
                       window_pages=2)
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([4 * 96, 4 * 96 - 2])  # 96 pages; the second row's last one partial
    sums = torch.randn(2, 96, 16, generator=g) * 4  # (the grid: as many blocks as the longest row has)
    grids, chunks, pages = press.select(sums, lengths)
    _, candidate = press.block_roles(lengths, 96)
    assert not (pages & ~candidate).any()  # sinks, window and partial pages are never candidates
    chunk_of_page = torch.arange(96) // 3
    assert not (pages & ~chunks[:, chunk_of_page]).any()  # a page only in a kept chunk
    assert not (chunks & ~grids[:, torch.arange(chunks.shape[1]) // 4]).any()  # a chunk only in a kept grid
    for row in range(2):
        n_grids = 8  # 96 pages / 12 pages per grid
        assert abs(int(grids[row].sum()) - 0.5 * n_grids) <= 1
        in_grids = candidate[row].view(-1, 3).any(-1) & grids[row].repeat_interleave(4)
        assert abs(int(chunks[row].sum()) - 0.4 * int(in_grids.sum())) <= 1
        in_chunks = candidate[row] & chunks[row].repeat_interleave(3)
        assert abs(int(pages[row].sum()) - 0.3 * int(in_chunks.sum())) <= 1
        assert pages[row].sum() >= 1


def test_the_selection_follows_the_anchor():
    """Pages whose vector is the anchor's direction win at every level."""
    press = CHESSPress(preset="aggressive", page_size=4, page_stride=4, chunk_pages=2, grid_chunks=2)
    lengths = torch.tensor([4 * 40])
    sums = torch.randn(1, 40, 8, generator=torch.Generator().manual_seed(1)) * 0.1
    sums[0, 38:40] = torch.tensor([4.0] + [0.0] * 7)  # the window's pages point along the first axis
    sums[0, 13] = torch.tensor([40.0] + [0.0] * 7)  # one page far along it
    _, _, pages = press.select(sums, lengths)
    assert pages[0].nonzero().flatten().tolist() == [13]


def test_mean_pooled_scores_are_eq_4_on_eq_2_vectors():
    """A chunk's (grid's) score is the dot product of the anchor with the mean vector of its candidate children."""
    press = CHESSPress(ratio=0.3, page_size=4, page_stride=4, chunk_pages=3, grid_chunks=2, sink_pages=1,
                       window_pages=2,
                       pooling="mean")
    lengths = torch.tensor([4 * 30 - 1])
    sums = torch.randn(1, 30, 8, generator=torch.Generator().manual_seed(2))
    vectors, anchor, candidate = press.page_vectors(sums, lengths)
    s_page = (vectors @ anchor[..., None])[..., 0]
    s_chunk, chunk_in = press._pool(s_page, candidate, 3)
    chunk_vectors = torch.stack([vectors[0, c * 3:(c + 1) * 3][candidate[0, c * 3:(c + 1) * 3]].mean(0)
                                 for c in range(10) if candidate[0, c * 3:(c + 1) * 3].any()])
    torch.testing.assert_close(s_chunk[chunk_in], chunk_vectors @ anchor[0])
    s_grid, grid_in = press._pool(s_chunk, chunk_in, 2)
    grid_vectors = torch.stack([chunk_vectors[i:i + 2].mean(0) for i in (0, 2, 4, 6)] + [chunk_vectors[8:].mean(0)])
    torch.testing.assert_close(s_grid[grid_in], grid_vectors @ anchor[0])


def test_max_pooling_keeps_a_lone_relevant_page_that_the_mean_drowns():
    """One page along the anchor, in a grid whose other pages point away: the mean of the grid ranks it last, so
    Algorithm 1 drops the page with its grid; scored by its best page, the grid (and the page) is kept."""
    lengths = torch.tensor([4 * 40])
    sums = torch.randn(1, 40, 8, generator=torch.Generator().manual_seed(3)) * 0.1
    sums[0, 38:40, 0] = 4.0  # the window's pages (the anchor) point along the first axis
    sums[0, 16:32, 0] = -8.0  # a grid pointing away from it ...
    sums[0, 21, 0] = 12.0  # ... but for one page far along it
    for pooling, kept in (("mean", False), ("max", True)):
        press = CHESSPress(ratios=(0.5, 0.5, 0.5), page_size=4, page_stride=4, chunk_pages=4, grid_chunks=4,
                           pooling=pooling)
        _, _, pages = press.select(sums, lengths)
        assert bool(pages[0, 21]) is kept, pooling


def test_overlapping_page_vectors_are_the_means_of_their_tokens():
    """With `page_stride` < `page_size`, page k's vector is the mean key of the `page_size` tokens from
    `k * page_stride`; candidates are the pages whose tokens are all candidates; the anchor is the window's mean."""
    press = CHESSPress(ratio=0.3, page_size=8, page_stride=4, sink_pages=1, window_pages=2, centre=False)
    n, d = 4 * 25 + 2, 6  # 25 complete blocks of 4 tokens, then a partial one
    keys = torch.randn(1, n, d, generator=torch.Generator().manual_seed(4))
    sums = torch.zeros(1, 30, d).index_add_(1, torch.arange(n) // 4, keys)
    vectors, anchor, candidate = press.page_vectors(sums, torch.tensor([n]))
    assert vectors.shape[1] == candidate.shape[1] == 30  # a page per block of the grid
    for k in range(24):
        torch.testing.assert_close(vectors[0, k], keys[0, 4 * k: 4 * k + 8].mean(0))
    # On the grid of 8-token pages: the sink is blocks 0-1; the window the last two whole pages, blocks 20-23, and
    # the partial page, blocks 24-25 (10 tokens)
    assert candidate[0].nonzero().flatten().tolist() == list(range(2, 19))  # page 19 reaches block 20
    window_means = torch.stack([keys[0, 80:88].mean(0), keys[0, 88:96].mean(0), keys[0, 96:].mean(0)])
    torch.testing.assert_close(anchor[0], window_means.mean(0))
    centred = CHESSPress(ratio=0.3, page_size=8, page_stride=4)
    v, a, c = centred.page_vectors(sums, torch.tensor([n]))
    torch.testing.assert_close(v, vectors - vectors[0, c[0]].mean(0))
    torch.testing.assert_close(a, anchor - vectors[0, c[0]].mean(0))


def test_overlapping_pages_keep_a_span_that_a_page_boundary_cuts():
    """Two blocks along the anchor, either side of a boundary of the non-overlapping pages: selecting one page, the
    pages at a stride of half their size attend both blocks, the paper's pages one of them."""
    lengths = torch.tensor([4 * 40])
    sums = torch.randn(1, 44, 8, generator=torch.Generator().manual_seed(5)) * 0.1
    sums[0, 36:40, 0] = 4.0  # the window's blocks (the anchor) point along the first axis
    sums[0, 13:15, 0] = 12.0  # blocks 13 and 14: the end of 8-token page 6 and the start of page 7
    one = {"ratios": (1.0, 1.0, 0.03), "sink_pages": 1, "window_pages": 2}
    half = CHESSPress(page_size=8, page_stride=4, **one)
    blocks = half.blocks_of(half.select(sums, lengths)[-1])
    assert blocks[0].nonzero().flatten().tolist() == [13, 14]  # the page from block 13
    whole = CHESSPress(page_size=8, page_stride=8, **one)
    sums8 = sums.view(1, 22, 2, 8).sum(2)
    pages = whole.select(sums8, lengths)[-1][0].nonzero().flatten().tolist()
    assert len(pages) == 1 and pages[0] in (6, 7)  # one of the two halves: the span is cut


@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.3, 0.5])
def test_overlapping_pages_attend_the_ratio_of_the_candidate_blocks(ratio):
    """Algorithm 1's last level takes the best pages while their blocks fit the budget: the three fractions of the
    candidates' blocks; pages only in kept chunks; with every ratio 1, every candidate block."""
    lengths = torch.tensor([4 * 200, 4 * 170 - 3])
    sums = torch.randn(2, 210, 16, generator=torch.Generator().manual_seed(6))
    press = CHESSPress(ratio=ratio, page_size=16, page_stride=4, chunk_pages=4, grid_chunks=4)
    _, chunks, pages = press.select(sums, lengths)
    blocks = press.blocks_of(pages)
    _, candidate = press.page_vectors(sums, lengths)[1:]
    n_blocks = press.blocks_of(candidate).sum(-1)
    budget = (ratio * n_blocks).ceil()
    assert (blocks.sum(-1) <= budget).all() and (blocks.sum(-1) >= budget - 3).all()  # a page adds 1-4 blocks
    assert not (pages & ~candidate).any()
    assert not (pages & ~chunks.repeat_interleave(4, dim=1)[:, : pages.shape[1]]).any()
    everything = CHESSPress(ratios=(1.0, 1.0, 1.0), page_size=16, page_stride=4)
    _, _, pages = everything.select(sums, lengths)
    assert torch.equal(everything.blocks_of(pages), everything.blocks_of(candidate))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_overlapping_pages_at_every_ratio_one_equal_the_full_cache(arch):
    model = make_model(arch, "sdpa")
    ids = prompt(70)
    reference = greedy(model, ids, new=12)
    with CHESSPress(ratios=(1.0, 1.0, 1.0), page_size=8, page_stride=4, reselect="always")(model):
        assert torch.equal(greedy(model, ids, new=12), reference)


def test_overlapping_working_context_holds_the_selected_blocks():
    model = make_model("llama", "sdpa")
    n = 4 * 40 + 3
    press = CHESSPress(preset="aggressive", page_size=8, page_stride=4, chunk_pages=2, grid_chunks=2,
                       reselect="never")
    with press(model):
        for step, cache in enumerate(decode(model, prompt(n), 10)):
            if step == 0:
                continue
            total = n + step - 1
            complete = total // 4
            complete = total // 8 * 2  # blocks of whole 8-token pages
            expected = set(range(8)) | set(range((complete - 4) * 4, total + 1))  # sink page, window, partial
            for block in cache.state.selected[0].nonzero().flatten().tolist():
                expected |= set(range(block * 4, block * 4 + 4))
            for layer in chess_layers(cache):
                assert set(layer.positions[0, 0].tolist()) == expected, step


def test_working_context_is_sinks_selected_window_and_partial_page_and_is_shared_by_all_layers():
    model = make_model("llama", "sdpa")
    n = 8 * 20 + 3
    press = chess(preset="aggressive", reselect="never", sink_pages=1, window_pages=2)
    with press(model):
        for step, cache in enumerate(decode(model, prompt(n), 30)):
            if step == 0:
                continue
            total = n + step - 1  # tokens stored before this step's token
            complete = total // B
            layers = chess_layers(cache)
            selected = cache.state.selected[0].nonzero().flatten()
            expected = set(range(B))  # the sink page
            for page in [*selected.tolist(), *range(complete - 2, complete)]:
                expected |= set(range(page * B, page * B + B))
            expected |= set(range(complete * B, total))  # the partial page
            expected |= {total}  # this step's token, appended
            for layer in layers:
                assert set(layer.positions[0, 0].tolist()) == expected, step
                assert torch.equal(layer.positions, layers[0].positions)  # one selection for every layer
                # sink + selected + window + partial page (invalid slots past its end), + tokens since the rebuild
                assert layer.keys.shape[-2] <= (1 + len(selected) + 2 + 2) * B  # does not grow
            assert selections(cache) == 1  # reselect="never": the first decoding step's only


def test_working_context_holds_the_stored_keys():
    model = make_model("phi3", "eager")
    with chess(ratio=0.3, reselect="always")(model):
        for cache in decode(model, prompt(90), 12):
            pass
    for layer in chess_layers(cache):
        slots = layer.positions[:, :1, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        assert torch.equal(layer.keys, layer.store_keys.gather(2, slots))
        assert torch.equal(layer.values, layer.store_values.gather(2, slots))
    stats = cache.stats()
    assert stats.logical_tokens == 102 and max(stats.attended_tokens) < 102
    assert stats.counts["selections"] == 13 and stats.seconds["step"] > 0
    # Selection, not eviction: every token stays resident, and the KV bytes count the store.
    layers = chess_layers(cache)
    assert set(stats.resident_tokens[i] for i in cache.state.columns) == {102}
    store = sum(layer.store_keys.nbytes + layer.store_values.nbytes for layer in layers)
    working = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    assert stats.kv_bytes == store + working


def test_uncertainty_of_constructed_distributions():
    vocab = 1000
    uniform = torch.zeros(vocab)
    entropy, varentropy = uncertainty(uniform)
    assert entropy.item() == pytest.approx(torch.log(torch.tensor(vocab)).item(), rel=1e-5)
    assert varentropy.item() == pytest.approx(0.0, abs=1e-4)
    peaked = torch.full((vocab,), -1e4)
    peaked[0] = 0.0
    assert uncertainty(peaked)[0].item() == pytest.approx(0.0, abs=1e-5)
    # Half the mass on one token, half spread: entropy and varentropy both high.
    mixed = torch.full((vocab,), 0.0)
    mixed[0] = torch.log(torch.tensor(vocab - 1.0))
    p = mixed.softmax(-1)
    entropy, varentropy = uncertainty(mixed)
    assert entropy.item() == pytest.approx(float(-(p * p.log()).sum()), rel=1e-5)
    assert varentropy.item() == pytest.approx(float((p * p.log().square()).sum() - entropy.square()), rel=1e-4)


def test_reselection_happens_exactly_when_both_thresholds_are_crossed():
    model = make_model("llama", "sdpa")
    vocab = model.config.vocab_size
    mixed = torch.zeros(1, 1, vocab, device=DEVICE)
    mixed[..., 0] = torch.log(torch.tensor(vocab - 1.0))  # high entropy and high varentropy
    entropy, varentropy = (float(x) for x in uncertainty(mixed[0, 0]))
    calm = torch.full((1, 1, vocab), -1e4, device=DEVICE)
    calm[..., 5] = 0.0
    uniform = torch.zeros(1, 1, vocab, device=DEVICE)  # high entropy, no varentropy
    given = {}  # the next-token logits each step's forward returns, in place of the model's
    hook = model.lm_head.register_forward_hook(lambda module, args, out: given.pop("logits", out))
    press = chess(preset="moderate", entropy_threshold=entropy - 0.01, varentropy_threshold=varentropy - 0.01)
    try:
        with press(model):
            cache = model(prompt(60)).cache
            assert selections(cache) == 1  # always after the prompt
            for logits, selects in [(calm, False), (mixed, True), (uniform, False), (calm, False), (mixed, True)]:
                before, given["logits"] = selections(cache), logits
                model(prompt(1), cache=cache)
                assert selections(cache) - before == int(selects)
        strict = chess(preset="moderate", entropy_threshold=entropy + 0.01, varentropy_threshold=0.0)
        with strict(model):
            cache = model(prompt(60)).cache
            given["logits"] = mixed
            model(prompt(1), cache=cache)
            assert selections(cache) == 1
    finally:
        hook.remove()


def test_reselect_every_n_steps_and_always():
    model = make_model("llama", "sdpa")
    for press, expected in [(chess(preset="moderate", reselect_every=4), 1 + 20 // 4),
                            (chess(preset="moderate", reselect="always"), 21),
                            (chess(preset="moderate", reselect="never"), 1)]:
        with press(model):
            for cache in decode(model, prompt(70), 20):
                pass
        assert selections(cache) == expected, press


@pytest.mark.parametrize("padded", [False, True])
def test_a_continued_prompt_is_read_densely_and_selected_for_as_one_prompt(padded):
    """A forward of several tokens after the prompt (a question asked of a context compressed before it) is a
    prompt: it attends to every stored token, as a full cache holding the same KV does, and re-selects even with
    reselect="never", with its tokens in the anchor's window. A context then its question leave CHESS where the
    two as one prompt do (the same logits and pages); after decoding steps (a gathered working context) the
    question still reads every token; one-token steps do not re-select."""
    from transformers import DynamicCache

    model = make_model("llama", "sdpa")
    press = chess(ratio=0.2, reselect="never")
    context, question = prompt(20 * B + 3, batch=2, seed=0), prompt(13, batch=2, seed=1)
    n, token = context.shape[1], torch.tensor([[7], [9]], device=DEVICE)
    mask = torch.ones(2, n + 1 + question.shape[1], dtype=torch.long, device=DEVICE)
    if padded:
        mask[1, :7] = 0
    whole = torch.cat([context, question], dim=1)
    without_step = torch.cat([mask[:, :n], mask[:, n + 1:]], dim=1)
    full = model(whole, attention_mask=without_step).logits[:, -1]
    with press(model):
        at_once = model(whole, attention_mask=without_step).cache
        cache = model(context, attention_mask=mask[:, :n]).cache
        continued = model(question, cache=cache, attention_mask=without_step).logits[:, -1]
        torch.testing.assert_close(continued, full, rtol=1e-4, atol=1e-4)
        selected, at_once_selected = cache.state.selected, at_once.state.selected  # (grids of their page sums)
        width = max(selected.shape[1], at_once_selected.shape[1])
        assert torch.equal(pad_columns(selected, width), pad_columns(at_once_selected, width))
        assert selections(cache) == 4  # the context's and the question's, one per row

        cache = model(context, attention_mask=mask[:, :n]).cache
        model(token, cache=cache, attention_mask=mask[:, :n + 1])
        assert selections(cache) == 2 and all(layer.compressed for layer in chess_layers(cache))
        assert max(cache.stats().attended_tokens) < n  # the step read the working context
    stored = DynamicCache(config=model.config)
    for i, layer in enumerate(chess_layers(cache)):
        stored.update(layer.store_keys[:, :, :n + 1].clone(), layer.store_values[:, :, :n + 1].clone(), i)
    reference = model(question, cache=stored, attention_mask=mask).logits
    with press(model):
        continued = model(question, cache=cache, attention_mask=mask).logits
        assert selections(cache) == 4
        # A draft being verified (generate asks for the logits of all its tokens) is decoding, not a prompt.
        draft = torch.cat([mask, torch.ones(2, 4, dtype=torch.long, device=DEVICE)], dim=1)
        model(question[:, :4], cache=cache, attention_mask=draft, logits_to_keep=4)
        assert selections(cache) == 4 and all(layer.compressed for layer in chess_layers(cache))
    torch.testing.assert_close(continued, reference, rtol=1e-4, atol=1e-4)


def test_batch_rows_select_independently_with_padding():
    model = make_model("qwen3", "sdpa")
    rows = [prompt(60, seed=3)[0], prompt(100, seed=4)[0]]
    ids = torch.zeros(2, 100, dtype=torch.long, device=DEVICE)
    mask = torch.zeros(2, 100, dtype=torch.long, device=DEVICE)
    for i, row in enumerate(rows):
        ids[i, 100 - len(row):], mask[i, 100 - len(row):] = row, 1
    with chess(preset="aggressive", reselect="always")(model):
        batched = greedy(model, ids, mask, new=12)
        for i, row in enumerate(rows):
            assert torch.equal(batched[i, 100:], greedy(model, row[None], new=12)[0, len(row):]), f"row {i}"


def test_calibrate_sets_the_percentiles():
    model, tok = make_model("llama", "sdpa", vocab_size=420), make_tokenizer()  # the tokenizer's ids
    texts = ["The committee reviewed every proposal. " * 6, "Dr. Smith paid $3.50 for it. " * 5]
    press = chess(preset="aggressive")
    assert press.calibrate(model, tok, texts, percentile=90) is press
    with torch.no_grad():
        entropy, varentropy = zip(*(uncertainty(model(tok(t, return_tensors="pt").input_ids.to(DEVICE)).logits[0])
                                    for t in texts))
    assert press.entropy_threshold == pytest.approx(float(torch.cat(entropy).quantile(0.9)), rel=1e-5)
    assert press.varentropy_threshold == pytest.approx(float(torch.cat(varentropy).quantile(0.9)), rel=1e-5)
    with pytest.raises(ValueError, match="percentile"):
        press.calibrate(model, tok, texts, percentile=100)


def test_presets_are_table_1():
    assert CHESSPress(preset="aggressive").retention == PRESETS["aggressive"] == (0.5, 0.2, 0.1)
    assert CHESSPress(ratio=0.125).retention == pytest.approx((0.5, 0.5, 0.5))
    assert "preset='moderate'" in repr(CHESSPress(preset="moderate"))


def test_the_papers_letter_is_one_option_away():
    """sparsekv's defaults are 16-token pages overlapping by half, max pooling and centred scores; `paper=True`
    gives the paper's 32-token pages one after the other, eq. 2's mean and eq. 4 uncentred; an option given
    explicitly wins either way."""

    ours, papers = CHESSPress(ratio=0.1), CHESSPress(ratio=0.1, paper=True)
    assert (ours.page_size, ours.pooling, ours.centre) == (16, "max", True)
    assert (papers.page_size, papers.pooling, papers.centre) == (32, "mean", False)
    assert CHESSPress(ratio=0.1, paper=True, centre=True).centre is True
    assert CHESSPress(ratio=0.1, pooling="mean").page_size == 16
    assert (ours.page_stride, papers.page_stride) == (8, 32)  # overlapping by half; the paper's one after the other
    assert CHESSPress(ratio=0.1, page_size=15).page_stride == 15  # an odd page: no half
    assert CHESSPress(ratio=0.1, paper=True, page_size=16).page_stride == 16
    assert CHESSPress(ratio=0.1, paper=True, page_stride=8).page_size == 32
    assert make_press("chess:paper=true,ratio=0.1") == papers


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of preset"),
    ({"preset": "aggressive", "ratio": 0.1}, "exactly one of preset"),
    ({"read_budget": 63},
     r"read_budget must be an integer >= 64 \(tokens a step attends; \(sink_pages \+ window_pages \+ 1\)"),
    ({"read_budget": 100, "ratio": 0.1}, "got ratio and read_budget"),
    ({"preset": "wild"}, "preset must be one of"),
    ({"ratios": (0.5, 0.2)}, "ratios must be three fractions"),
    ({"ratios": (0.5, 0.0, 0.1)}, r"ratios\[1\] must be in \(0, 1\]"),
    ({"ratio": 1.5}, r"ratio must be in \(0, 1\]"),
    ({"preset": "moderate", "page_size": 0}, "page_size must be an integer >= 1"),
    ({"preset": "moderate", "window_pages": 0}, "window_pages must be an integer >= 1"),
    ({"preset": "moderate", "page_size": 16, "page_stride": 32}, r"page_stride must be an integer in \[1, 16\]"),
    ({"preset": "moderate", "page_size": 16, "page_stride": 6}, r"page_stride must divide page_size \(16\)"),
    ({"preset": "moderate", "reselect": "sometimes"}, "reselect must be one of"),
    ({"preset": "moderate", "pooling": "median"}, "pooling must be one of mean, max"),
    ({"preset": "moderate", "paper": "yes"}, "paper must be True or False"),
    ({"preset": "moderate", "reselect_every": 0}, "reselect_every must be an integer >= 1"),
    ({"preset": "moderate", "entropy_threshold": -1}, "entropy_threshold must be a number >= 0"),
])
def test_bad_configuration_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CHESSPress(**kwargs)


def test_budget_is_refused_naming_read_budget():
    """`budget=` means tokens kept; CHESS keeps every token, and what a step reads has a name of its own."""
    with pytest.raises(TypeError, match=r"unknown option budget=128: it is called read_budget now .*read_budget=128"):
        CHESSPress(budget=128)
    with pytest.raises(ValueError, match=r"no option 'budget'; it is called read_budget now .*chess:read_budget=128"):
        make_press("chess:budget=128")
    assert make_press("chess", budget=128).read_budget == 128  # a sweep's budget is what a CHESS step reads




@pytest.mark.parametrize("options", [{"ratio": 0.1}, {"ratio": 0.5}, {"preset": "aggressive"}, {"read_budget": 200},
                                     {"ratio": 0.3, "paper": True}, {"read_budget": 300, "paper": True},
                                     {"ratios": (0.9, 0.5, 0.3), "page_size": 8, "chunk_pages": 3}],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_a_selection_holds_no_more_blocks_than_a_compiled_step_reads(options):
    """A compiled cache's working context has a fixed width: the blocks always attended and the most a selection
    can hold on rows of at most that many blocks (`most_selected`). Algorithm 1's selections, on rows of any
    length up to it and scores without ties, never hold more."""
    from sparsekv.presses.chess_pages import most_selected

    press = CHESSPress(**options)
    g = torch.Generator().manual_seed(0)
    for tokens in (150, 1000, 4000):
        n_blocks = -(-tokens // press.page_stride)
        lengths = torch.tensor([tokens, tokens - 37, tokens // 2, tokens // 3 + 5])
        sums = torch.randn(len(lengths), n_blocks, 8, generator=g)
        blocks = press.blocks_of(press.select(sums, lengths)[-1]).sum(-1)
        assert int(blocks.max()) <= most_selected(press, n_blocks), (tokens, blocks.tolist())


@pytest.mark.parametrize("arch,cap", [("llama", None), ("gemma3", 3.0)])
@torch.no_grad()
def test_chess_reads_the_logits_the_model_returns(arch, cap):
    """The trigger reads each forward's logits at the model's output head, inside the forward: those the model
    returns, capped as Gemma 3 caps them after its head (`final_logit_softcapping`), once a forward."""
    seen = []

    class Recording(CHESSPress):
        def end_forward(self, ctx):
            seen.append(ctx.logits.clone())
            super().end_forward(ctx)

    model = make_model(arch, **({"final_logit_softcapping": cap} if cap else {}))
    press = Recording(**{"page_size": B, "page_stride": B, "chunk_pages": 2, "grid_chunks": 2, "ratio": 0.5})
    ids = prompt(40)
    with press(model):
        cache = press.make_cache(model)
        out = [model(ids, cache=cache, use_cache=True).logits]
        out.append(model(out[0][:, -1:].argmax(-1), cache=cache, use_cache=True).logits)
    assert len(seen) == 2 and all(torch.equal(s, o) for s, o in zip(seen, out))
    if cap is not None:
        assert out[0].abs().max() <= cap
