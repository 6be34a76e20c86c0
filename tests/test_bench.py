"""`sparsekv bench`: summary rows and ratios, latency slope, memory sampling, the plot, bad inputs.

Offline: a word-level tokenizer over the needle prompt's words and a tiny random Llama.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch
from conftest import make_model, save_model_dir
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sparsekv import bench, make_press
from sparsekv.bench import Setting, medians, run_bench, slope_per_1k, step_latencies, summarize, sweep
from sparsekv.bench.timing import _release_memory
from sparsekv.cli import main
from sparsekv.evaluation.tasks import INTRO, NOISE
from sparsekv.evaluation.words import WORDS as KEYS


@pytest.fixture(scope="module")
def tokenizer():
    """Whole words and punctuation of the needle prompt; anything else (numbers) is <unk>."""
    words = " ".join([*NOISE, INTRO, *KEYS, "One of the special magic numbers for is What mentioned in provided text"])
    pre = pre_tokenizers.Whitespace()
    vocab = ["<pad>", "<s>", "</s>", "<unk>", *dict.fromkeys(w for w, _ in pre.pre_tokenize_str(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_model("llama", "sdpa", vocab_size=len(tokenizer), max_position_embeddings=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model, tokenizer):
    return save_model_dir(tmp_path_factory, model, tokenizer)


@pytest.fixture(scope="module")
def measured(model, tokenizer, tmp_path_factory):
    """One small real benchmark: two presses at two ratios, plot and JSON written."""
    out = tmp_path_factory.mktemp("bench")
    rows = run_bench(model, tokenizer, [240], ["snapkv", "streamingllm"], ratios=[0.5, 1.0], max_new_tokens=6,
                     repeats=2, plot=out / "lat.png", json_path=out / "rows.json")
    return rows, out


# --- pure functions ----------------------------------------------------------------------------------------------
def test_slope_on_synthetic_timestamps():
    # latency grows by 0.004 ms per generated token, i.e. 4 ms per 1,000, from 10 ms; prefill 0.5 s
    latencies = [10 + 0.004 * i for i in range(2000)]
    stamps = [0.5]
    for ms in latencies:
        stamps.append(stamps[-1] + ms / 1000)
    assert step_latencies(stamps) == pytest.approx(latencies)
    assert slope_per_1k(step_latencies(stamps)) == pytest.approx(4.0, rel=1e-6)
    assert slope_per_1k([7.0] * 50) == pytest.approx(0.0, abs=1e-9)
    assert slope_per_1k([1.0] * 31) is None  # too few steps to tell growth from jitter
    jittery = [10 + 0.004 * i + (40 if i % 17 == 0 else 0) for i in range(64)]  # a slow step now and then
    assert slope_per_1k(jittery) == pytest.approx(4.0, rel=1e-6)


def test_running_median_window():
    values = [1, 100, 2, 3, 200, 4]
    assert bench.running_median(values, window=3) == [1, 50.5, 2, 3, 3, 4]


def fake_run(prefill, steps, peak, kv_bytes, resident):
    return {"prefill_s": prefill, "steps_ms": steps, "peak_mb": peak, "cuda_peak_mb": None,
            "resident": resident, "attended": resident, "kv_bytes": kv_bytes}


def test_rows_and_ratios_are_ratios_of_the_medians():
    triples = sweep([1000], ["h2o"], ratios=[0.25])
    press, full, oracle = triples[0]
    assert (full, oracle) == (Setting("full", 1000), Setting("full", 250))
    runs = {
        full: [fake_run(2.0, [10, 12, 11], 300, 4 * 2**20, 1002), fake_run(4.0, [20, 30, 25], 500, 4 * 2**20, 1002)],
        oracle: [fake_run(0.5, [4, 4, 5], 90, 2**20, 252), fake_run(0.7, [5, 6, 7], 110, 2**20, 252)],
        press: [fake_run(2.5, [5, 6, 6], 200, 2**20, 250), fake_run(3.5, [6, 8, 8], 220, 2**20, 250)],
    }
    rows = {row["config"]: row for row in summarize(runs, triples, [1000])}
    assert list(rows) == ["full", "oracle", "h2o r=0.25"]
    row, f, o = rows["h2o r=0.25"], rows["full"], rows["oracle"]
    assert (f["length"], o["length"], row["length"], row["kept"]) == (1000, 250, 1000, 250)
    # decode ms/token: median over runs of each run's median step
    assert (f["decode_ms"], o["decode_ms"], row["decode_ms"]) == (18.0, 5.0, 7.0)
    assert row["decode_vs_oracle"] == pytest.approx(7.0 / 5.0)
    assert row["decode_vs_full"] == pytest.approx(7.0 / 18.0)
    assert row["prefill_vs_full"] == pytest.approx(3.0 / 3.0)
    assert row["prefill_vs_oracle"] == pytest.approx(3.0 / 0.6)
    assert row["peak_vs_full"] == pytest.approx(210 / 400)
    assert row["kv_vs_full"] == pytest.approx(0.25)
    assert row["curve"] == [5.5, 7.0, 7.0]  # per-step median over the runs
    assert f["decode_vs_oracle"] is None and f["prefill_vs_full"] is None  # references get no ratios
    table = bench.format_rows(list(rows.values()))
    assert "/oracle" in table and "GPU peak MB" not in table and "ms/1k tok" not in table  # 3 steps: no slope
    assert max(len(line) for line in table.splitlines()) <= 120
    assert f"{7.0 / 5.0:.2f}" in table.splitlines()[-1]


def test_medians_slope_uses_the_median_curve():
    runs = [fake_run(1, list(range(1, 41)), 0, 0, 1), fake_run(1, list(range(3, 43)), 0, 0, 1)]
    assert medians(runs)["slope"] == pytest.approx(1000.0)  # +1 ms per token


def test_peak_rss_sees_an_allocation():
    # Earlier tests' garbage freed first (as a run does): collected inside the block, it would lower the RSS by
    # as much as the allocation raises it.
    _release_memory()
    with bench.PeakRSS(interval=0.001) as rss:
        block = torch.ones(64 * 2**20 // 4)  # 64 MB, touched, held long enough for many samples, then freed
        time.sleep(0.05)
        del block
    assert rss.peak_mb > 48


# --- a real (tiny) run -------------------------------------------------------------------------------------------
def test_run_rows_consistent(measured):
    rows, _ = measured
    by = {row["config"]: row for row in rows}
    # ratio 1.0's oracle is the full cache itself: measured once
    assert sorted(by) == ["full", "oracle", "snapkv r=0.5", "snapkv r=1", "streamingllm r=0.5", "streamingllm r=1"]
    full, oracle = by["full"], by["oracle"]
    assert (full["length"], oracle["length"]) == (240, 120)
    for name in ("snapkv r=0.5", "streamingllm r=0.5"):
        row = by[name]
        assert len(row["curve"]) == 5  # exactly max_new_tokens - 1 decoding steps
        assert row["decode_vs_oracle"] == pytest.approx(row["decode_ms"] / oracle["decode_ms"])
        assert row["decode_vs_full"] == pytest.approx(row["decode_ms"] / full["decode_ms"])
        assert row["kv_vs_full"] == pytest.approx(row["kv_mb"] / full["kv_mb"])
        assert row["resident"] < full["resident"] and row["attended"] <= row["resident"]
    # the final cache: prompt + generated tokens (the last one is never fed back)
    assert full["resident"] == 240 + 5 and oracle["resident"] == 120 + 5
    assert by["streamingllm r=0.5"]["resident"] == 120  # held at its budget while decoding
    assert by["snapkv r=0.5"]["resident"] == 120 + 5  # grows by the generated tokens
    assert by["snapkv r=1"]["decode_vs_oracle"] == pytest.approx(by["snapkv r=1"]["decode_vs_full"])


def test_plot_and_json_written(measured):
    rows, out = measured
    assert (out / "lat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "rows.json").read_text())
    assert saved["max_new_tokens"] == 6 and saved["repeats"] == 2
    assert saved["dtype"] == "float32" and saved["environment"]["torch"] == torch.__version__
    assert [r["config"] for r in saved["rows"]] == [r["config"] for r in rows]
    assert statistics.median(saved["rows"][0]["curve"]) > 0


# --- batches: throughput --------------------------------------------------------------------------------------------
def test_a_sweep_at_several_batch_sizes_and_ragged_rows():
    triples = sweep([1000], ["snapkv"], ratios=[0.1], batch_sizes=[1, 4], ragged=True)
    assert [(p.batch, f.batch, o.batch) for p, f, o in triples] == [(1, 1, 1), (4, 4, 4)]
    press, full, oracle = triples[1]
    assert press.row_lengths() == full.row_lengths() == [1000, 833, 667, 500]
    assert oracle == Setting("full", 100, batch=4, ragged=True) and oracle.row_lengths() == [100, 83, 67, 50]
    assert Setting("full", 1000, batch=3).row_lengths() == [1000] * 3
    ids, mask = bench.batch_inputs(torch.arange(10)[None], [4, 2], pad_id=-1)
    assert ids.tolist() == [[6, 7, 8, 9], [-1, -1, 8, 9]] and mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    with pytest.raises(ValueError, match="--budgets: 600 exceeds the 500-token prompt of a row"):
        sweep([1000], ["snapkv"], budgets=[600], batch_sizes=[2], ragged=True)


def test_batched_run_reports_throughput_per_batch(model, tokenizer, tmp_path):
    plot = tmp_path / "lat.png"
    rows = run_bench(model, tokenizer, [160], ["streamingllm"], ratios=[0.5], max_new_tokens=4, repeats=1,
                     plot=plot, batch_sizes=[1, 3], ragged=True)
    by = {(row["config"], row["batch"]): row for row in rows}
    assert sorted(by) == [(c, b) for c in ("full", "oracle", "streamingllm r=0.5") for b in (1, 3)]
    for row in rows:
        assert row["tok_s"] == pytest.approx(row["batch"] * 1000 / row["decode_ms"])
    press, full = by["streamingllm r=0.5", 3], by["full", 3]
    assert press["tok_vs_full"] == pytest.approx(press["tok_s"] / full["tok_s"])
    # tokens per sequence in the padded batch: the longest row (160 tokens) and the generated ones; StreamingLLM
    # holds half of the longest row
    assert full["resident"] == 160 + 3 and press["resident"] == 80
    assert press["kv_vs_full"] < 0.8  # allocated bytes: the rows' storage, room to grow included
    assert plot.exists() and (tmp_path / "lat_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tok/s" in bench.format_rows(rows)


def test_capacity_finds_the_largest_batch_within_the_budget(model, tokenizer, monkeypatch):
    """Memory is faked as the KV the batch holds (the real peak is noise for a tiny model): the press keeping
    half the prompt fits twice the full cache's batch, and the search stops at `max_batch`."""
    real = bench.measure

    def measure(model, ids, press, new_tokens, pad, mask, rows_apart):
        run = real(model, ids, press, new_tokens, pad, mask, rows_apart)
        return {**run, "peak_mb": ids.shape[0] * run["resident"]}  # 1 MB per token held

    monkeypatch.setattr(bench.run, "measure", measure)  # run_capacity looks both up in its own module
    monkeypatch.setattr(bench.run, "model_mb", lambda model: 0.0)
    rows = bench.run_capacity(model, tokenizer, [200], ["streamingllm"], ratios=[0.5], memory_budget_gb=850 / 1024,
                              max_batch=8, max_new_tokens=2)
    by = {row["config"]: row for row in rows}
    assert by["full"]["batch"] == 4 and by["full"]["memory_mb"] == 4 * 201  # 8 x 201 tokens exceed 850
    assert by["streamingllm r=0.5"]["batch"] == 8 and by["streamingllm r=0.5"]["capped"]  # 8 x 100 fit: capped
    assert by["full"]["tok_s"] > 0
    assert "largest batch in 0.83 GB" in bench.format_capacity(rows, 0.83) and "8+" in bench.format_capacity(rows, 1)
    with pytest.raises(ValueError, match="--memory-budget: must be a positive number"):
        bench.run_capacity(model, tokenizer, [200], ["streamingllm"], memory_budget_gb=0)
    # `exact`: bisected between the power of 2 that fit and the one that did not (1 MB a token held: 6 x 201 fit
    # in 1,250 MB, 7 x 201 do not; doubling alone stops at 4)
    rows = {exact: bench.run_capacity(model, tokenizer, [200], ["streamingllm"], ratios=[0.5], max_batch=16,
                                      memory_budget_gb=1250 / 1024, max_new_tokens=2, exact=exact)
            for exact in (False, True)}
    full, press = rows[True][0], rows[True][-1]
    assert rows[False][0]["batch"] == 4 and full["batch"] == 6 and full["memory_mb"] == 6 * 201
    per_row = press["memory_mb"] / press["batch"]
    assert rows[False][-1]["batch"] == 8 and press["batch"] == int(1250 // per_row) > 8 and not press["capped"]
    # `max_batch` (10) between two powers of 2 is tried too: it fits (12 would), and the search stops there
    capped = bench.run_capacity(model, tokenizer, [200], ["streamingllm"], ratios=[0.5], max_batch=10,
                                memory_budget_gb=1250 / 1024, max_new_tokens=2, exact=True)[-1]
    assert capped["batch"] == 10 and capped["capped"]


def test_rows_apart_hold_what_the_batch_holds(model, tokenizer, monkeypatch):
    """`--rows-apart`: prompts prefilled one row at a time and joined hold the same KV as the batch prefilled
    together, and decode what the batch prefilled together on all but the last token decodes (`prefill_rows`);
    presses that cannot join are refused before any run."""
    runs = {apart: run_bench(model, tokenizer, [160], ["h2o"], ratios=[0.5], max_new_tokens=4, repeats=1,
                             batch_sizes=[3], ragged=True, rows_apart=apart) for apart in (False, True)}
    for together, apart in zip(*runs.values()):
        assert (together["config"], together["resident"], together["attended"]) == \
            (apart["config"], apart["resident"], apart["attended"])
    # SentenceKV (its stores joined), rows of one length (at ratio 0.5 a shorter row alone is kept whole): it
    # attends one token more apart, the prompt's last, read as a decoding step and so always attended
    stores = {apart: run_bench(model, tokenizer, [200], ["sentencekv"], ratios=[0.5], max_new_tokens=3, repeats=1,
                               batch_sizes=[2], rows_apart=apart) for apart in (False, True)}
    assert [row["config"] for row in stores[True]] == ["full", "oracle", "sentencekv r=0.5"]
    for together, apart in zip(*stores.values()):
        press = together["config"].startswith("sentencekv")
        assert together["config"] == apart["config"] and apart["attended"] == together["attended"] + press
    ids, mask = bench.batch_inputs(torch.arange(3, 163)[None], [160, 120], pad_id=0)
    press = make_press("h2o", ratio=0.5)
    with press(model), torch.no_grad():
        positions = (mask[:, :-1].cumsum(-1) - 1).clamp(min=0)  # as generate counts them
        cache = model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions, use_cache=True).cache
        reference = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, min_new_tokens=4,
                                   do_sample=False, pad_token_id=0)
    seen, real = [], bench.timed_generate
    monkeypatch.setattr(bench.timing, "timed_generate", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    bench.measure(model, ids, press, 4, 0, mask, rows_apart=True)
    assert torch.equal(seen[0][0].sequences, reference)
    with pytest.raises(ValueError, match="--rows-apart: chess r=0.5 cannot join"):
        run_bench(model, tokenizer, [160], ["chess"], ratios=[0.5], max_new_tokens=2, repeats=1, rows_apart=True)


# --- bad inputs --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(presses=["nope"]), "known presses: full, snapkv, h2o, streamingllm"),
        (dict(lengths=[600]), "exceeds the model's context (512 tokens)"),
        (dict(budgets=[300]), "--budgets: 300 exceeds the 200-token prompt"),
        (dict(budgets=[16]), "must be at least window_size=32"),
        (dict(ratios=[1.5]), "--ratios: each must be in (0, 1]"),
        (dict(max_new_tokens=1), "--max-new-tokens: at least 2"),
        (dict(repeats=0), "--repeats: at least 1"),
        (dict(presses=["full"]), "at least one press other than full"),
        (dict(plot="/nonexistent/dir/x.png"), "--plot: the folder"),
        (dict(plot="lat.svg"), "must be a .png file"),
    ],
)
def test_bad_inputs_raise(model, tokenizer, kwargs, message):
    args = dict(lengths=[200], presses=["snapkv"], ratios=[0.5], max_new_tokens=4, repeats=1)
    if "budgets" in kwargs:
        args["ratios"] = None
    with pytest.raises(ValueError) as err:
        run_bench(model, tokenizer, **{**args, **kwargs})
    assert message in str(err.value)


def test_command_line(model_dir, tmp_path, capsys):
    plot = tmp_path / "lat.png"
    h2o = "h2o:window_size=8"  # (under its default floor of 64 tokens, a budget of 40 is refused)
    assert main(["bench", "--model", str(model_dir), "--lengths", "100", "--presses", h2o, "--budgets", "40",
                 "--max-new-tokens", "3", "--repeats", "1", "--plot", str(plot), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "/oracle" in out and f"{h2o} b=40" in out and plot.exists()
    assert main(["bench", "--model", str(model_dir), "--lengths", "100", "--presses", h2o, "--budgets", "40",
                 "--max-new-tokens", "3", "--repeats", "1", "--batch-sizes", "2", "--rows-apart"]) == 0
    assert f"{h2o} b=40" in capsys.readouterr().out
    for argv, message in [
        (["--presses", "snapkv,bogus"], "unknown press 'bogus'; known presses"),
        (["--lengths", "5000"], "exceeds the model's context"),
        (["--ratios", "0"], "must be in (0, 1]"),
        (["--ratios", "0.5", "--budgets", "10"], "not allowed with argument"),
        (["--memory-budget", "1", "--batch-sizes", "1,2"], "--memory-budget: a positive number of GB, without"),
        (["--exact-batch"], "--exact-batch: only with --memory-budget"),
        (["--presses", "chess", "--rows-apart"], "--rows-apart: chess r=0.1 cannot join"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "--model", str(model_dir), "--lengths", "100", *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_the_demo_reads_the_prompt_once_and_answers_as_generate(model_dir, model, tokenizer, capsys, monkeypatch):
    """`sparsekv demo`: one prefill for every press, each answer the one `generate` gives under the press, a row
    per press and the legend under the table."""
    from sparsekv import demo
    from sparsekv.niah import build_needle_prompt
    from sparsekv.prefill import Prefill

    runs, real_run = [], Prefill.run.__func__
    monkeypatch.setattr(Prefill, "run", classmethod(lambda cls, *a, **k: runs.append(1) or real_run(cls, *a, **k)))
    rows = demo.run_demo(str(model_dir), n_tokens=200, ratio=0.5, max_new_tokens=4)
    out = capsys.readouterr().out
    assert runs == [1] and [r["press"] for r in rows] == ["full cache", "SnapKV", "H2O", "StreamingLLM", "ChunkKV",
                                                         "SentenceKV", "CHESS"]
    assert "read per step:" in out and "CHESS evicts nothing" in out
    full = rows[0]["resident"]
    assert rows[-1]["resident"] == full and all(r["resident"] < full for r in rows[1:-1])
    ids, _ = build_needle_prompt(tokenizer, 200, depth=0.5)
    snap = make_press("snapkv", ratio=0.5)
    with snap(model):
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    text = " ".join(tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True).split())
    assert rows[1]["answer"] == text
