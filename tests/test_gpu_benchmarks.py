"""The GPU benchmark scripts (benchmarks/, docs/gpu.md), run here on the CPU so that they keep working between the
machines that have a GPU: models of real shapes, and one short run of each script on a random-weight SmolLM2."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CHAT_TEMPLATE, make_tokenizer

from benchmarks import (
    chunked_prefill, compiled_decode, decode_vs_oracle, head_budgets, profile_step, random_bench, step_ops,
)
from benchmarks.random_models import SHAPES, random_model


@pytest.mark.parametrize("shape, parameters", [("llama-3.1-8b", 8_030_261_248), ("qwen2.5-0.5b", 494_032_768),
                                               ("smollm2-135m", 134_515_008), ("host-bound", 24_133_888)])
def test_shapes_are_the_published_models(shape, parameters):
    model = random_model(shape, "meta")  # no memory: shapes only
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="--shape: one of"):
        random_model("llama-9b", "meta")
    assert set(SHAPES) == {"llama-3.1-8b", "qwen2.5-0.5b", "smollm2-135m", "host-bound"}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return str(path)


SMALL = ["--shape", "smollm2-135m", "--device", "cpu", "--dtype", "float32"]


def test_decode_vs_oracle_on_a_random_model(tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "rows.json"
    decode_vs_oracle.main([*SMALL, "--tokenizer", tokenizer_dir, "--length", "600", "--steps", "2", "--repeats",
                           "1", "--batch", "2", "--no-full", "--presses", "snapkv,h2o,sentencekv", "--json", str(out)])
    rows = {row["config"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"snapkv", "h2o", "sentencekv", "oracle"} and rows["oracle"]["ratio"] == 1.0
    # KV copied into a working set per step: SentenceKV's loads (some, on random weights), none for the others
    assert rows["snapkv"]["loaded_kb"] == 0 and rows["oracle"]["loaded_kb"] is None
    assert rows["sentencekv"]["loaded_kb"] >= 0
    assert all(row["batch"] == 2 and row["length"] == 600 and row["ms"] > 0 for row in rows.values())
    assert "host syncs" not in capsys.readouterr().out  # counted on CUDA only
    with pytest.raises(SystemExit):  # --count-syncs needs CUDA
        decode_vs_oracle.main([*SMALL, "--tokenizer", tokenizer_dir, "--count-syncs"])


def test_profile_step_on_a_random_model(tokenizer_dir, capsys):
    profile_step.main([*SMALL, "--tokenizer", tokenizer_dir, "--length", "600", "--steps", "2", "--top", "3",
                       "--presses", "streamingllm", "--python", "5", "--diff"])
    out = capsys.readouterr().out
    table = out.split("per step\n")[-1]
    assert "oracle" in table and "streamingllm" in table
    assert out.count("cProfile, 2 steps") == 2 and "(forward)" in out  # the oracle's and the press's functions
    assert "streamingllm against the oracle" in out and "oracle against" not in out


@pytest.mark.slow
def test_profile_step_compiled_on_a_random_model(tokenizer_dir, capsys):
    """`--compiled`: each configuration's steps compiled (one graph a step, a guard check before it), profiled in
    rounds, reported against the compiled oracle's host time (the medians', and the median of each round's ratio),
    which is 1 for the oracle itself."""
    profile_step.main([*SMALL, "--tokenizer", tokenizer_dir, "--length", "600", "--steps", "3", "--top", "3",
                       "--presses", "streamingllm", "--compiled", "--diff", "--rounds", "2"])
    out = capsys.readouterr().out
    table = out.split("per step (host ms: profiled, 3 steps; medians of 2 rounds)\n")[-1].splitlines()[2:]
    rows = {cells[0]: cells[1:] for cells in map(str.split, table)}  # (below the header and its rule)
    assert set(rows) == {"oracle", "streamingllm"}
    # wall, guard check and graphs ms, graphs, aten ops, host time / the oracle's, by round
    assert rows["oracle"][5] == rows["oracle"][6] == "1.000" and rows["oracle"][3] == rows["streamingllm"][3] == "1"
    assert out.count("== streamingllm compiled (last round)") == 1
    assert all(float(cells[1]) > 0 and float(cells[2]) > 0 for cells in rows.values())
    diff = out.split("streamingllm compiled against the compiled oracle")[1].split("compiled: per step")[0]
    # each graph's events are named by its hash: the diff compares them under one name
    assert "## Call CompiledFxGraph" in out.split("== streamingllm")[0] and "## Call" not in diff


def test_profile_step_op_differences():
    """`--diff`: a press's calls and host ms a step less the oracle's, ops missing on either side counted as 0,
    the largest extra time first."""
    press = {"aten::mm": (10, 5.0), "aten::scatter_": (4, 0.8), "aten::bmm": (3, 1.0)}
    oracle = {"aten::mm": (10, 4.9), "aten::cat": (2, 0.3)}
    rows = profile_step.op_differences(press, oracle, top=3)
    assert [row["op"] for row in rows] == ["aten::bmm", "aten::scatter_", "aten::mm"]
    assert rows[1]["calls"] == 4 and rows[0]["ms"] == 1.0 and abs(rows[2]["ms"] - 0.1) < 1e-9
    assert profile_step.op_differences(press, oracle, top=10)[-1] == {"op": "aten::cat", "calls": -2, "ms": -0.3}


def test_step_ops_on_a_random_model(tokenizer_dir, capsys):
    """Ops per step by source line: a press's own lines are charged to it (SentenceKV's plan and loads), the
    model's ops to "model"; on a CPU model no column of ops on host tensors (every op is on the host)."""
    step_ops.main([*SMALL, "--tokenizer", tokenizer_dir, "--length", "600", "--steps", "2", "--lines", "40",
                   "--presses", "sentencekv", "--ratio", "0.25"])
    out = capsys.readouterr().out
    assert "on host tensors" not in out
    lines = out.split("sentencekv: ")[-1].splitlines()[1:]
    assert any(line.split()[-1] == "model" for line in lines)
    assert any("presses/sentence" in line for line in lines)  # sentencekv.py or its executor, sentence_step.py


def test_random_bench_on_a_random_model(tokenizer_dir, capsys):
    random_bench.main([*SMALL, "--tokenizer", tokenizer_dir, "--lengths", "600", "--max-new-tokens", "3",
                       "--presses", "snapkv"])
    out = capsys.readouterr().out
    assert "snapkv r=0.1" in out and "oracle" in out and "full" in out
    random_bench.main([*SMALL, "--tokenizer", tokenizer_dir, "--lengths", "600", "--max-new-tokens", "3",
                       "--presses", "h2o", "--memory-budget", "64", "--max-batch", "2", "--rows-apart"])
    assert "2+" in capsys.readouterr().out  # (gpu_benchmarks.sh's capacity32k_apart: every configuration fits 2)
    with pytest.raises(SystemExit):  # refused as `sparsekv bench` refuses it
        random_bench.main([*SMALL, "--tokenizer", tokenizer_dir, "--exact-batch"])
    assert "--exact-batch: only with --memory-budget" in capsys.readouterr().err


def test_chunked_prefill_on_a_random_model(tokenizer_dir, capsys):
    """Pieces of 128 tokens: the same answer as one forward for the full cache and the presses; a press that
    refuses a prompt in pieces would be printed, not raised (a random model: only the table's shape is checked)."""
    chunked_prefill.main([*SMALL, "--tokenizer", tokenizer_dir, "--length", "300", "--chunks", "0,128",
                          "--new-tokens", "2", "--presses", "snapkv,sentencekv", "--ratio", "0.25"])
    out = capsys.readouterr().out
    table = out.split("above the level before each generation\n")[-1]
    rows = [line.split() for line in table.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("full", "one"), ("full", "128"), ("snapkv", "one"), ("snapkv", "128"),
                                            ("sentencekv", "one"), ("sentencekv", "128")]
    assert all(r[-1] == "yes" for r in rows)
    with pytest.raises(SystemExit):  # the prompt in one forward is the reference
        chunked_prefill.main([*SMALL, "--tokenizer", tokenizer_dir, "--chunks", "256"])


def test_head_budgets_on_a_random_model(tokenizer_dir, capsys):
    """AdaKV over SnapKV holds the same real tokens as SnapKV in slots at least as many (its heads' widest), and
    PyramidKV as many as SnapKV (its layers' budgets average SnapKV's): the table's columns say so."""
    head_budgets.main([*SMALL, "--tokenizer", tokenizer_dir, "--length", "600", "--ratios", "0.25", "--steps", "2",
                       "--presses", "snapkv,adakv,pyramidkv"])
    table = capsys.readouterr().out.split("against snapkv\n")[-1]
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert list(rows) == ["snapkv", "adakv", "pyramidkv"]
    kv, fill = {name: float(row[3]) for name, row in rows.items()}, {name: float(row[4]) for name, row in rows.items()}
    assert kv["snapkv"] == 1.0 and kv["adakv"] >= 1.0 and fill["snapkv"] == 1.0 and fill["adakv"] <= 1.0
    assert abs(kv["adakv"] * fill["adakv"] - 1.0) < 0.02 and abs(kv["pyramidkv"] - 1.0) < 0.02


def test_sync_counting_reports_each_step_and_where(monkeypatch):
    """`--count-syncs`' counter, on the CPU: torch's sync debug mode warns from inside the forward, the counter
    sees each warning in its step and names the innermost sparsekv / transformers frame it came from."""
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)  # the warnings are made below
    model = random_model("smollm2-135m", "cpu", torch.float32)
    model.config.num_hidden_layers = 2
    model.model.layers = model.model.layers[:2]
    seen = []

    def warn_on_first_step(module, args):
        if len(seen) < 2:  # the first step's two layers: two "synchronisations", none after
            seen.append(1)
            import warnings
            warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("an unrelated warning")  # not counted
    token = torch.tensor([[1]])
    cache = model(torch.tensor([[1, 2, 3]]), use_cache=True).past_key_values
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(warn_on_first_step)
    per_step, sites = decode_vs_oracle.syncs_per_step(model, cache, token, steps=3)
    assert per_step == [2, 0, 0]
    (site, n), = sites.items()
    assert n == 2 and site.startswith("llama/modeling_llama.py:") and "forward" in site


def test_compiled_decode_on_a_random_model(tmp_path, capsys):
    out = tmp_path / "rows.json"
    compiled_decode.main([*SMALL, "--length", "200", "--new", "5", "--warmup", "1", "--repeats", "2", "--backend",
                          "eager", "--presses", "streamingllm", "--json", str(out)])
    rows = {(row["config"], row["mode"]): row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(c, m) for c in ("oracle", "streamingllm") for m in ("eager", "compiled")}
    assert rows[("oracle", "eager")]["vs_oracle"] == rows[("oracle", "compiled")]["vs_oracle"] == 1.0
    assert rows[("oracle", "eager")]["vs_oracle_rounds"] == rows[("oracle", "compiled")]["vs_oracle_rounds"] == 1.0
    assert all(row["vs_oracle_rounds"] > 0 for row in rows.values())  # (each round's ratio, then their median)
    assert rows[("streamingllm", "eager")]["vs_eager"] == 1.0 and rows[("streamingllm", "eager")]["compile_s"] is None
    assert rows[("streamingllm", "compiled")]["same_tokens"] is True
    assert rows[("oracle", "compiled")]["same_tokens"] is True
    assert all(row["steps"] == 2 * 3 and row["ms"] > 0 for row in rows.values())  # 5 tokens: 4 steps, 1 left out
    assert "compiled by eager" in capsys.readouterr().out
