"""benchmarks/kvpress_compare.py: the parts that run in sparsekv's venv (kvpress needs another transformers), and
its reply loop, which the kvpress venv runs, driven here with a press that keeps everything."""

from __future__ import annotations

import argparse
import contextlib
import json

import pytest
import torch
from conftest import greedy, make_model, prompt

from benchmarks import kvpress_compare

EOS = 2  # conftest's models


def keeps_everything(model):
    """A stand-in for a kvpress press (applied as `with press(model):`) that compresses nothing."""
    return contextlib.nullcontext(model)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")  # (kvpress's transformers knows no other)
@pytest.mark.parametrize("mode", ["question", "agnostic"])
def test_with_nothing_compressed_a_reply_is_generates_greedy_reply(mode):
    """The reply loop gives generate's greedy tokens when nothing is compressed, and puts every token at its
    position in the whole sequence: the question after the context ("agnostic", read from the context's cache),
    each new token after the last, whatever the cache holds (a compressed one holds fewer)."""
    model = make_model("llama")
    context, question = prompt(40, seed=1), prompt(8, seed=2)
    ids = torch.cat([context, question], 1)
    expected = greedy(model, ids, new=12)[0, ids.shape[1]:].tolist()
    if EOS in expected:
        expected = expected[:expected.index(EOS) + 1]
    positions = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: positions.append(kwargs.get("position_ids")), with_kwargs=True)
    try:
        got = kvpress_compare.reply(model, keeps_everything, context, question, mode, 12, eos={EOS})
    finally:
        hook.remove()
    assert got == expected
    steps = [p.tolist() for p in positions[1 if mode == "question" else 2:]]
    assert steps == [[[48 + i]] for i in range(len(got) - 1)]
    if mode == "agnostic":
        assert positions[1].tolist() == [list(range(40, 48))]


def test_replies_are_scored_as_sparsekv_eval_scores_them(tmp_path, capsys):
    """One row per press, ratio and mode, with `sparsekv eval`'s scoring: 2 of 3 replies hold the answer."""
    replies = tmp_path / "replies.jsonl"
    rows = [{"press": "snapkv", "ratio": 0.1, "mode": "question", "answers": ["8056020"], "metric": "all",
             "reply": reply} for reply in ("The number is 8056020.", "I do not know.", "8056020")]
    rows.append({**rows[0], "ratio": 0.25})
    replies.write_text("".join(json.dumps(row) + "\n" for row in rows))
    kvpress_compare.score(argparse.Namespace(replies=str(replies)))
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("kvpress")]
    assert [line[:6] for line in lines] == [["kvpress", "snapkv", "0.25", "question", "1", "100.0"],
                                            ["kvpress", "snapkv", "0.1", "question", "3", "66.7"]]


def test_rulers_mean_beside_sparsekv_runs(tmp_path, capsys):
    """The mean over tasks of each task's accuracy, kvpress's replies beside a `sparsekv eval` folder's runs of
    the same tasks, length and mode; a row missing a task has no mean; the Markdown table bolds each column's
    best, and the plot is drawn."""
    replies = tmp_path / "replies.jsonl"
    base = {"mode": "agnostic", "length": 4096, "metric": "all", "answers": ["42"]}
    rows = [{**base, "press": "snapkv", "ratio": 0.5, "task": "vt", "reply": "42"},
            {**base, "press": "snapkv", "ratio": 0.5, "task": "cwe", "reply": "no"},
            {**base, "press": "full", "ratio": 1.0, "task": "vt", "reply": "42"},
            {**base, "press": "full", "ratio": 1.0, "task": "cwe", "reply": "42"}]
    replies.write_text("".join(json.dumps(row) + "\n" for row in rows))
    runs = {("snapkv", 0.5, "agnostic", "vt"): 100.0, ("snapkv", 0.5, "agnostic", "cwe"): 50.0,
            ("snapkv", 0.25, "agnostic", "vt"): 100.0,  # cwe missing: no mean
            ("snapkv", 0.5, "question", "vt"): 0.0, ("snapkv", 0.5, "question", "cwe"): 0.0,  # another mode
            ("full", 1.0, "question", "vt"): 100.0, ("full", 1.0, "question", "cwe"): 100.0}
    for i, ((press, ratio, mode, task), value) in enumerate(runs.items()):
        run = tmp_path / "results" / str(i)
        run.mkdir(parents=True)
        (run / "metrics.json").write_text(json.dumps({"task": task, "press": press, "ratio": ratio, "mode": mode,
                                                      "length": 4096, "score": value, "samples": 2}))
    plot = tmp_path / "ruler.png"
    kvpress_compare.score(argparse.Namespace(replies=str(replies), sparsekv=str(tmp_path / "results"),
                                             markdown=True, plot=str(plot), title="t"))
    out = capsys.readouterr().out
    table = {tuple(line.split()[:3]): line.split()[3:6] for line in out.splitlines()
             if line.startswith(("kvpress", "sparsekv"))}
    assert table[("kvpress", "snapkv", "0.5")] == ["agnostic", "2", "50.0"]
    assert table[("sparsekv", "snapkv", "0.5")] == ["agnostic", "4", "75.0"]
    assert table[("sparsekv", "snapkv", "0.25")] == ["agnostic", "2", "-"]
    assert table[("kvpress", "full", "1")][:3] == ["-", "2", "100.0"]
    assert "| sparsekv snapkv | **75.0** | - |  | 4 |" in out and "| kvpress snapkv | 50.0 | - |  | 2 |" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
