"""`sparsekv eval` and `sparsekv report`: task generators, scoring, the sweep (resume, process split), report.

Everything runs offline on a byte-level BPE tokenizer trained in memory and tiny random models.
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import CHAT_TEMPLATE, make_model, save_model_dir
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import sparsekv
from sparsekv.cli import main
from sparsekv.environment import source_digest
from sparsekv.evaluation import (
    TASKS,
    EvalConfig,
    Evaluator,
    Sample,
    encode,
    format_report,
    hub,
    load_and_evaluate,
    load_results,
    plot,
    runner,
)
from sparsekv.evaluation.scoring import aggregate, score
from sparsekv.evaluation.ruler import NOISE as NOISE_LINE
from sparsekv.evaluation.tasks import INTRO, NOISE, read_haystack
from sparsekv.evaluation.words import WORDS


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE, trained in memory on the tasks' words, with a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS), " ".join(NOISE), INTRO, " ".join(str(i) for i in range(100))] * 3
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_model("llama", "sdpa", vocab_size=len(tokenizer), max_position_embeddings=1024)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model, tokenizer):
    return save_model_dir(tmp_path_factory, model, tokenizer)


def config(tmp_path, **overrides) -> EvalConfig:
    base = dict(model="tiny", tasks=["niah_single"], presses=["snapkv", "h2o"], ratios=[0.5], lengths=[200],
                samples=3, mode="question", out=str(tmp_path / "results"), max_new_tokens=3)
    return EvalConfig(**{**base, **overrides})


# --- task generators -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", [t for t in TASKS if TASKS[t].family != "ruler"])
@pytest.mark.parametrize("length", [400, 1500])
def test_length_within_two_percent(tokenizer, task, length):
    sample = TASKS[task].make(tokenizer, length, seed=3, depth=0.4)
    assert abs(len(encode(tokenizer, sample)) - length) <= 0.02 * length


@pytest.mark.parametrize("task", TASKS)
def test_seeds_are_deterministic(tokenizer, task):
    make, length = TASKS[task].make, 1500 if TASKS[task].family == "ruler" else 500
    assert make(tokenizer, length, seed=1, depth=0.5) == make(tokenizer, length, seed=1, depth=0.5)
    assert make(tokenizer, length, seed=1, depth=0.5) != make(tokenizer, length, seed=2, depth=0.5)


@pytest.mark.parametrize("task", ["niah_single", "passkey"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_once_at_its_depth(tokenizer, task, depth):
    sample = TASKS[task].make(tokenizer, 800, seed=0, depth=depth)
    needle = re.search(r"One of the special magic numbers for \w+ is: \d+\.|The pass key is \d+\. Remember it\.",
                       sample.context).group(0)
    assert sample.context.count(needle) == 1
    haystack = sample.context.split("\n", 1)[1]
    assert abs(haystack.index(needle) / (len(haystack) - len(needle)) - depth) < 0.05
    assert sample.answers[0] in needle


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "passkey"])
def test_needle_answers_are_in_the_context(tokenizer, task):
    sample = TASKS[task].make(tokenizer, 600, seed=5, depth=0.3)
    assert sample.answers and all(sample.context.count(a) == (2 if task == "passkey" else 1) for a in sample.answers)
    n_needles = sample.context.count("special magic numbers for")
    assert n_needles == {"niah_single": 1, "niah_multikey": 4, "passkey": 0}[task]


# --- RULER's configuration ---------------------------------------------------------------------------------------
RULER = [t for t in TASKS if TASKS[t].family == "ruler"]
# RULER's synthetic.yaml: haystack, needles in the context, values asked, the value's shape
NIAH = {"niah_single_1": ("noise", 1, 1, r"\d{7}"), "niah_single_2": ("essay", 1, 1, r"\d{7}"),
        "niah_single_3": ("essay", 1, 1, r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"),
        "niah_multikey_1": ("essay", 4, 1, r"\d{7}"), "niah_multikey_2": ("needle", None, 1, r"\d{7}"),
        "niah_multikey_3": ("needle", None, 1, r"[0-9a-f-]{36}"), "niah_multivalue": ("essay", 4, 4, r"\d{7}"),
        "niah_multiquery": ("essay", 4, 4, r"\d{7}")}


def test_ruler_configuration_is_rulers_thirteen_less_the_two_downloads():
    assert RULER == [*NIAH, "vt", "cwe", "fwe"]
    assert {t: TASKS[t].max_new_tokens for t in RULER} == {**{t: 128 for t in NIAH}, "vt": 30, "cwe": 120, "fwe": 50}
    assert EvalConfig(model="m", tasks=["ruler", "passkey"], presses=["snapkv"]).tasks == [*RULER, "passkey"]
    with pytest.raises(ValueError, match="qa_1 is RULER's question answering over SQuAD.*ruler:qa_1 loads it"):
        EvalConfig(model="m", tasks=["qa_1"], presses=["snapkv"])


@pytest.mark.parametrize("task", RULER)
@pytest.mark.parametrize("length", [1500, 2500])
def test_ruler_prompt_and_answer_fill_the_length(tokenizer, task, length):
    """As RULER: the prompt plus the tokens its answer may take fit in `length`, short of it by less than a unit
    of haystack (a needle line of two UUIDs is ~60 tokens of this byte-level tokenizer)."""
    sample = TASKS[task].make(tokenizer, length, seed=3)
    budget = length - TASKS[task].max_new_tokens
    assert budget - 70 <= len(encode(tokenizer, sample)) <= budget


@pytest.mark.parametrize("task", list(NIAH))
def test_ruler_needles_in_their_haystack(tokenizer, task):
    haystack, n_needles, n_answers, shape = NIAH[task]
    sample = TASKS[task].make(tokenizer, 1500, seed=7)
    lines = sample.context.split("\n")
    needles = re.findall(r"One of the special magic (?:numbers|uuids) for [\w-]+ is: [\w-]+\.", sample.context)
    if n_needles is not None:
        assert len(needles) == n_needles
    else:  # every line of the haystack is a needle, with its own key
        assert len(needles) == len(lines) - 1 and len({n.split(" is: ")[0] for n in needles}) == len(needles)
    if haystack == "noise":
        assert set(lines[1:]) == {NOISE_LINE, *needles}
    if haystack == "essay":
        assert "The grass is green." not in sample.context and len(lines) == 2
    assert len(sample.answers) == n_answers and all(re.fullmatch(shape, a) for a in sample.answers)
    assert all(sample.context.count(f"is: {a}.") == 1 for a in sample.answers)
    asked = re.search(r"for (.+) mentioned", sample.question).group(1).replace(", and ", ", ").split(", ")
    assert len(asked) == (4 if task == "niah_multiquery" else 1)
    for key in asked:  # the asked keys' values are the answers
        assert set(re.findall(rf"for {re.escape(key)} is: ([\w-]+)\.", sample.context)) <= set(sample.answers)
    singular = n_answers == 1  # RULER's wording: "A special magic number is hidden", "What is the ..."
    assert sample.context.startswith("A special magic" if singular else "Some special magic")
    assert sample.question.startswith("What is the" if singular else "What are all the")
    assert sample.answer_prefix.endswith(" is" if singular else " are")


def test_ruler_variable_tracking_chain_is_recoverable(tokenizer):
    sample = TASKS["vt"].make(tokenizer, 1500, seed=2)
    example, asked = sample.context.rsplit("Memorize and track", 1)
    assert "Question: Find all variables" in example  # the worked example, its answer included, before the task
    value = re.search(r"value (\d+)", sample.question).group(1)
    links = dict(re.findall(r"VAR (\w+) = (?:VAR )?(\w+)", asked))
    holding = {v for v in links if links[v] == value}
    while True:  # follow the chain from the value
        more = {v for v, src in links.items() if src in holding} - holding
        if not more:
            break
        holding |= more
    assert holding == set(sample.answers) and len(sample.answers) == 5


@pytest.mark.parametrize("task, top", [("cwe", 10), ("fwe", 3)])
def test_ruler_word_tasks_answers_are_the_most_frequent(tokenizer, task, top):
    sample = TASKS[task].make(tokenizer, 1500, seed=4)
    text = sample.context.rsplit("\n", 1)[1] if task == "cwe" else sample.context
    words = [w for w in re.findall(r"(?:\d+\. )?([a-z.-]+)", text) if w != "..."]
    counts = {w: words.count(w) for w in set(words)}
    ranked = sorted(counts.values(), reverse=True)
    assert len(sample.answers) == top
    assert min(counts[a] for a in sample.answers) > ranked[top]  # strictly more frequent than any other word


def test_user_haystack(tokenizer, tmp_path):
    path = tmp_path / "essay.txt"
    path.write_text("Rivers carve valleys over long ages. Wind shapes the dunes!\n\nRain falls on the hills? Yes.")
    sentences = read_haystack(path)
    assert sentences[:2] == ["Rivers carve valleys over long ages.", "Wind shapes the dunes!"]
    sample = TASKS["niah_single"].make(tokenizer, 500, seed=0, depth=0.5, haystack=sentences)
    assert "Wind shapes the dunes!" in sample.context and "The grass is green." not in sample.context
    assert sample.context.count(sample.answers[0]) == 1


# --- prose needle tasks ----------------------------------------------------------------------------------------
PROSE_VALUE = {"prose_number": r"\d{7}", "prose_code": r"[A-Z0-9]{3}-[A-Z0-9]{4}",
               "prose_name": r"[A-Z]\w+(?: [A-Z]\w+){1,2}", "prose_multikey": r"[A-Z0-9]{3}-[A-Z0-9]{4}"}


@pytest.mark.parametrize("task", list(PROSE_VALUE))
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prose_needle_at_its_depth_in_real_text(tokenizer, task, depth):
    sample = TASKS[task].make(tokenizer, 1200, seed=4, depth=depth)
    assert TASKS[task].family == "prose"
    (answer,) = sample.answers
    assert re.fullmatch(PROSE_VALUE[task], answer) and sample.context.count(answer) == 1
    if task in ("prose_code", "prose_multikey"):  # letters and digits in each part of the code
        assert all(re.search("[A-Z]", part) and re.search("[0-9]", part) for part in answer.split("-"))
    haystack = sample.context.split("\n\n", 1)[1]
    needle = next(s for s in re.split(r"(?<=\.) ", haystack) if answer in s)
    assert abs(haystack.index(needle) / (len(haystack) - len(needle)) - depth) < 0.05
    key = re.search(r"the (\w+) (?:report|archive|project)", sample.question).group(1)
    assert key in needle and sample.answer_prefix.endswith(("is", "by"))
    # the rest is the reference manual's running text, without its grammar rules and code blocks
    from sparsekv.evaluation.prose import prose_sentences

    prose = " ".join(prose_sentences())
    needles = r"The (?:access code|reference number) of the \w+ \w+ is [\w-]+\.|The \w+ project was led by [\w ]+\."
    assert all(part.strip() in prose for part in re.split(needles, haystack)) and "::=" not in prose


def test_prose_multikey_has_three_distractors(tokenizer):
    sample = TASKS["prose_multikey"].make(tokenizer, 1200, seed=2, depth=0.3)
    codes = re.findall(r"The access code of the (\w+) archive is ([A-Z0-9]{3}-[A-Z0-9]{4})\.", sample.context)
    assert len(codes) == 4 and len({k for k, _ in codes}) == 4 and len({v for _, v in codes}) == 4
    asked = dict(codes)[re.search(r"the (\w+) archive", sample.question).group(1)]
    assert sample.answers == [asked]


def test_prose_passages_differ_between_samples_and_follow_a_haystack_file(tokenizer, tmp_path):
    a, b = (TASKS["prose_code"].make(tokenizer, 800, seed=s, depth=0.5) for s in (0, 1))
    assert a.context.split("\n\n", 1)[1][:200] != b.context.split("\n\n", 1)[1][:200]  # other places in the text
    path = tmp_path / "story.txt"
    path.write_text("The lighthouse keeper counted the ships. " * 20 + "Fog rolled in from the sea. " * 20)
    sample = TASKS["prose_code"].make(tokenizer, 800, seed=0, depth=0.5, haystack=read_haystack(path))
    assert "lighthouse keeper" in sample.context and "Python" not in sample.context


def test_prompt_split_is_the_chat_template(tokenizer):
    sample = Sample("Some context here.", "What is it?", ["x"], "all", "It is")
    prompt = encode(tokenizer, sample)
    expected = "<|user|>\nSome context here.\nWhat is it?</s>\n<|assistant|>\nIt is"
    assert tokenizer.decode(prompt.ids[0]) == expected
    assert tokenizer.decode(prompt.context_ids[0]) == "<|user|>\nSome context here."
    assert len(prompt) == prompt.ids.shape[1]


# --- scoring ---------------------------------------------------------------------------------------------------
def test_scoring_follows_ruler():
    assert score(" 1234567.", ["1234567"], "all") == 1.0
    assert score("The numbers are 11 and 33", ["11", "22", "33", "44"], "all") == 0.5
    assert score("Paris, FRANCE", ["london", "france"], "any") == 1.0
    assert score("nothing", ["london", "france"], "any") == 0.0
    assert score("ab\x00cd", ["ab\ncd"], "all") == 1.0  # control characters become newlines
    assert aggregate([1.0, 0.5, 0.0, 0.5]) == 50.0 and aggregate([]) == 0.0
    with pytest.raises(ValueError, match="metric"):
        score("x", ["x"], "exact")


# --- the sweep -------------------------------------------------------------------------------------------------
def read_predictions(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "predictions.jsonl").read_text().splitlines()]


def test_sweep_writes_config_predictions_metrics(tmp_path, model, tokenizer):
    results = Evaluator(config(tmp_path, mode="both"), model, tokenizer).run_all()
    names = sorted(f"{m['press']}_{m['mode']}" for m in results)
    assert names == ["full_question", "h2o_agnostic", "h2o_question", "snapkv_agnostic", "snapkv_question"]
    run = tmp_path / "results" / "tiny" / "niah_single" / "snapkv_0.5_200_agnostic"
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.json", "predictions.jsonl"]
    predictions = read_predictions(run)
    assert [p["index"] for p in predictions] == [0, 1, 2]
    assert [p["depth"] for p in predictions] == [0.0, 0.5, 1.0]  # depth swept evenly
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["samples"] == 3 and 0 <= metrics["score"] <= 100
    assert json.loads((run / "config.json").read_text())["mode"] == "agnostic"


def test_a_run_records_what_the_cache_held_and_attended(tmp_path, model, tokenizer):
    # Measured at the end of each answer, not the nominal ratio: CHESS keeps every token and attends its pages.
    cfg = config(tmp_path, presses=["snapkv", "chess:page_size=8"], ratios=[0.25], lengths=[400], full=False)
    held = {m["press"]: m for m in Evaluator(cfg, model, tokenizer).run_all()}
    snapkv, chess = held["snapkv"], held["chess:page_size=8"]
    # SnapKV: a quarter of the prompt, plus the few generated tokens, of the tokens seen
    assert snapkv["kv_fraction"] == snapkv["attended_fraction"] == pytest.approx(0.25, abs=0.02)
    assert chess["kv_fraction"] == 1.0 and 0.2 < chess["attended_fraction"] < 0.5
    text = format_report(load_results(tmp_path / "results"))
    row = next(line.split() for line in text.splitlines() if "chess" in line)
    assert row[5:7] == ["1.00", f"{chess['attended_fraction']:.2f}"]  # KV kept, attended


def test_agnostic_equals_question_mode_without_compression(tmp_path, model, tokenizer):
    cfg = config(tmp_path, presses=["snapkv"], ratios=[1.0], mode="both", full=False, max_new_tokens=6)
    Evaluator(cfg, model, tokenizer).run_all()
    root = tmp_path / "results" / "tiny" / "niah_single"
    question, agnostic = (read_predictions(root / f"snapkv_1_200_{m}") for m in ("question", "agnostic"))
    assert [p["prediction"] for p in question] == [p["prediction"] for p in agnostic]


def test_resume_skips_finished_runs_and_answered_samples(tmp_path, model, tokenizer, monkeypatch):
    cfg = config(tmp_path, presses=["snapkv"], samples=4)
    Evaluator(cfg, model, tokenizer).run_all()
    run = tmp_path / "results" / "tiny" / "niah_single" / "snapkv_0.5_200_question"
    before = read_predictions(run)
    # Interrupt the run after two samples: its metrics are gone and only a shard with two predictions is left.
    (run / "metrics.json").unlink()
    (run / "predictions.jsonl").unlink()
    cut_short = '{"index": 3, "tru'
    (run / "predictions.rank0.jsonl").write_text("".join(json.dumps(p) + "\n" for p in before[:2]) + cut_short)
    answered = []
    real_answer = runner.answer
    monkeypatch.setattr(runner, "answer", lambda *a, **k: answered.append(a[3]) or real_answer(*a, **k))
    Evaluator(cfg, model, tokenizer).run_all()
    assert len(answered) == 2  # only samples 2 and 3 of the interrupted run; the full-cache run is skipped
    assert read_predictions(run) == before and not list(run.glob("predictions.rank*"))
    Evaluator(cfg, model, tokenizer).run_all()
    assert len(answered) == 2


def test_resume_refuses_other_settings(tmp_path, model, tokenizer):
    Evaluator(config(tmp_path, presses=["snapkv"]), model, tokenizer).run_all()
    run = tmp_path / "results" / "tiny" / "niah_single" / "snapkv_0.5_200_question"
    (run / "metrics.json").unlink()
    with pytest.raises(ValueError, match="other settings.*samples: 3 -> 5"):
        Evaluator(config(tmp_path, presses=["snapkv"], samples=5), model, tokenizer).run_all()


def test_a_finished_run_is_reused_only_with_the_same_settings(tmp_path, model, tokenizer, monkeypatch):
    cfg = config(tmp_path, presses=["snapkv"])
    first = Evaluator(cfg, model, tokenizer).run_all()
    answered = []
    monkeypatch.setattr(runner, "answer", lambda *a, **k: answered.append(1) or "")
    assert Evaluator(cfg, model, tokenizer).run_all() == first and not answered  # the same settings: reused
    for overrides, difference in [({"samples": 5}, "samples: 3 -> 5"), ({"seed": 7}, "seed: 0 -> 7"),
                                  ({"max_new_tokens": 4}, "max_new_tokens: 3 -> 4")]:
        with pytest.raises(ValueError, match=f"holds a finished run made with other settings.*{difference}"):
            Evaluator(config(tmp_path, presses=["snapkv"], **overrides), model, tokenizer).run_all()
    with pytest.raises(ValueError, match="dtype: 'float32' -> 'bfloat16'"):
        Evaluator(cfg, copy.deepcopy(model).to(torch.bfloat16), tokenizer).run_all()
    assert not answered


def test_a_run_made_under_other_press_defaults_is_not_reused(tmp_path, model, tokenizer):
    """A run's identity holds every option its press spec resolved to, defaults included: when a version
    changes a default (CHESS's pages, say), a stored run of the same spec is not taken for the new one."""
    cfg = config(tmp_path, presses=["snapkv"])
    Evaluator(cfg, model, tokenizer).run_all()
    stored = tmp_path / "results" / "tiny" / "niah_single" / "snapkv_0.5_200_question" / "metrics.json"
    metrics = json.loads(stored.read_text())
    assert "window_size=32" in metrics["identity"]["press_options"]
    metrics["identity"]["press_options"] = metrics["identity"]["press_options"].replace("window_size=32",
                                                                                        "window_size=16")
    stored.write_text(json.dumps(metrics))
    with pytest.raises(ValueError, match="other settings.*press_options"):
        Evaluator(cfg, model, tokenizer).run_all()


def test_a_finished_sweep_is_checked_before_it_is_reused_without_loading(tmp_path, model_dir):
    cfg = config(tmp_path, model=str(model_dir), presses=["snapkv"], samples=2)
    load_and_evaluate(cfg, distributed=False)
    assert len(load_and_evaluate(cfg, distributed=False)) == 2  # full + snapkv, read back
    with pytest.raises(ValueError, match="attn_implementation: 'sdpa' -> 'eager'"):
        load_and_evaluate(cfg, distributed=False, attn_implementation="eager")


def test_metrics_record_the_identity_and_the_environment(tmp_path, model, tokenizer):
    metrics = Evaluator(config(tmp_path, presses=["snapkv"]), model, tokenizer).run_all()[-1]
    assert metrics["identity"]["press"] == "snapkv" and metrics["identity"]["dtype"] == "float32"
    assert metrics["identity"]["attn_implementation"] == "sdpa" and metrics["identity"]["device"] == "cpu"
    env = metrics["environment"]
    assert env["sparsekv"] == sparsekv.__version__ and env["torch"] == torch.__version__
    assert env["transformers"] == transformers.__version__ and env["threads"] == torch.get_num_threads()
    assert "git_commit" in env and env["device"] == "cpu"
    assert env["source_digest"] == source_digest() and len(env["source_digest"]) == 12


def test_the_source_digest_names_the_code(tmp_path):
    """Equal files, equal digest, wherever they are; one byte or one name changed, another digest."""
    for root in (tmp_path / "a", tmp_path / "b"):
        (root / "presses").mkdir(parents=True)
        (root / "core.py").write_text("x = 1\n")
        (root / "presses" / "p.py").write_text("y = 2\n")
        (root / "notes.txt").write_text(str(root))  # not source
    a, b = source_digest(tmp_path / "a"), source_digest(tmp_path / "b")
    (tmp_path / "b" / "presses" / "p.py").write_text("y = 3\n")
    (tmp_path / "a" / "core.py").rename(tmp_path / "a" / "main.py")
    changed, renamed = (source_digest.__wrapped__(tmp_path / name) for name in "ba")  # (uncached)
    assert a == b and changed != b and renamed != a and changed != renamed


class FakeState:
    """accelerate.PartialState for process `index` of `count`, run one after the other."""

    def __init__(self, index, count):
        self.process_index, self.num_processes, self.is_main_process = index, count, index == 0

    def wait_for_everyone(self):
        pass

    def split_between_processes(self, items):
        from contextlib import nullcontext

        share = -(-len(items) // self.num_processes)
        return nullcontext(items[self.process_index * share : (self.process_index + 1) * share])


def test_samples_split_between_processes_and_merged(tmp_path, model, tokenizer):
    single = Evaluator(config(tmp_path / "one", samples=5), model, tokenizer).run_all()
    cfg = config(tmp_path / "two", samples=5)
    assert Evaluator(cfg, model, tokenizer, FakeState(1, 2)).run_all() == []  # rank 1: shards only
    run = tmp_path / "two" / "results" / "tiny" / "niah_single" / "h2o_0.5_200_question"
    assert [p["index"] for p in read_shard(run / "predictions.rank1.jsonl")] == [3, 4]
    merged = Evaluator(cfg, model, tokenizer, FakeState(0, 2)).run_all()  # rank 0: its share, then the merge
    assert [p["process"] for p in read_predictions(run)] == [0, 0, 0, 1, 1]
    assert not list(run.glob("predictions.rank*"))
    assert [(m["press"], m["score"]) for m in merged] == [(m["press"], m["score"]) for m in single]


def read_shard(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_press_errors_are_recorded_not_raised(tmp_path, model, tokenizer):
    # A budget of 16 is below SnapKV's 32-token window and H2O's 64-token floor (the press cannot be built); 500
    # exceeds the prompt, which is then kept whole.
    results = Evaluator(config(tmp_path, presses=["snapkv", "h2o"], budgets=[16, 500], full=False), model,
                        tokenizer).run_all()
    by_run = {(m["press"], m["budget"]): m for m in results}
    assert by_run[("snapkv", 16)]["errors"] == 3 and by_run[("snapkv", 16)]["score"] == 0
    run = tmp_path / "results" / "tiny" / "niah_single" / "snapkv_b16_200_question"
    assert "must be at least window_size=32" in read_predictions(run)[0]["error"]
    assert by_run[("h2o", 16)]["errors"] == 3 and by_run[("h2o", 500)]["errors"] == 0
    run = tmp_path / "results" / "tiny" / "niah_single" / "h2o_b16_200_question"
    assert "must be at least window_size=64" in read_predictions(run)[0]["error"]


# --- report ----------------------------------------------------------------------------------------------------
def synthetic_results(root: Path, tasks=(("niah_single", 100.0), ("passkey", 90.0))) -> None:
    def write(task, press, ratio, mode, score):
        run = root / "m" / task / f"{press}_{ratio}_1000_{mode}"
        run.mkdir(parents=True)
        metrics = dict(model="m", task=task, press=press, ratio=ratio, budget=None, length=1000, mode=mode,
                       samples=2, score=score, errors=0, kv_fraction=ratio, prompt_tokens=1000)
        (run / "metrics.json").write_text(json.dumps(metrics))

    for task, base in tasks:
        write(task, "full", 1.0, "question", base)
        for ratio in (0.5, 0.1):
            for mode in ("question", "agnostic"):
                write(task, "snapkv", ratio, mode, base * ratio)


def test_report_table_and_plot(tmp_path):
    synthetic_results(tmp_path)
    table = format_report(load_results(tmp_path))
    lines = table.splitlines()
    assert lines[0].startswith("noise tasks:")
    assert lines[1].split() == ["model", "length", "mode", "press", "kept", "KV", "kept", "attended", "niah_single",
                                "passkey", "mean", "95%", "CI", "n", "errors"]
    assert lines[3].split()[:10] == ["m", "1000", "-", "full", "1", "1.00", "1.00", "100.0", "90.0", "95.0"]
    # a run recorded before attended_fraction existed: attended is what it kept
    assert lines[4].split()[:10] == ["m", "1000", "question", "snapkv", "0.5", "0.50", "0.50", "50.0", "45.0", "47.5"]
    assert lines[3].split()[10:] == ["[46,", "100]", "2", "0"] and len(lines) == 3 + 5  # mean 95% of 4 pooled samples
    path = plot(load_results(tmp_path), tmp_path / "acc.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_keeps_task_families_apart(tmp_path):
    synthetic_results(tmp_path, tasks=(("niah_single", 100.0), ("prose_code", 50.0)))
    text = format_report(load_results(tmp_path))
    noise, prose = text.split("\n\n")  # families in alphabetical order
    assert noise.startswith("noise tasks") and "niah_single" in noise and "prose_code" not in noise
    assert prose.startswith("prose tasks") and "prose_code" in prose and "niah_single" not in prose
    full = next(line.split() for line in prose.splitlines() if " full " in line)
    assert full[7:9] == ["50.0", "50.0"]  # the prose mean is prose_code's alone, not averaged with niah_single
    from sparsekv.evaluation.report import figure

    titles = [ax.get_title() for ax in figure(load_results(tmp_path)).axes]
    assert len(titles) == 2 and "noise tasks" in titles[0] and "prose tasks" in titles[1]


def test_report_formats(tmp_path):
    import pandas as pd

    synthetic_results(tmp_path)
    results = load_results(tmp_path)
    md = format_report(results, "md").splitlines()
    assert md[0].startswith("### noise tasks") and md[2].startswith("| model | length |") and md[3].startswith("| ---")
    runs = pd.read_csv(io.StringIO(format_report(results, "csv")))
    assert len(runs) == 10 and {"family", "task", "score", "low", "high", "samples"} <= set(runs.columns)
    full = runs[(runs.press == "full") & (runs.task == "niah_single")].iloc[0]
    assert full.score == 100 and 34 < full.low < 35 and full.high == 100  # 2 of 2: Wilson [34.2, 100]
    records = json.loads(format_report(results, "json"))
    assert len(records) == 10 and records[0]["family"] == "noise"
    with pytest.raises(ValueError, match="--format"):
        format_report(results, "xlsx")


def test_wilson_interval():
    from sparsekv.evaluation.report import wilson

    lo, hi = wilson(50.0, 20)
    assert 29 < lo < 30 and 70 < hi < 71  # 10 of 20: [29.9, 70.1]
    assert wilson(100.0, 20)[1] == 100.0 and 83 < wilson(100.0, 20)[0] < 84
    assert wilson(0.0, 0) == (0.0, 100.0)


def test_a_missing_task_has_no_mean(tmp_path):
    synthetic_results(tmp_path)
    run = tmp_path / "m" / "passkey" / "snapkv_0.1_1000_question"
    for path in run.iterdir():
        path.unlink()
    run.rmdir()
    lines = format_report(load_results(tmp_path)).splitlines()
    row = next(line.split() for line in lines if line.split()[2:5] == ["question", "snapkv", "0.1"])
    assert row[7:10] == ["10.0", "-", "-"]  # niah_single, passkey (missing), mean (missing, not 10.0)


def test_plot_axes_fit_the_data_and_say_what_is_averaged(tmp_path):
    from sparsekv.evaluation.report import figure

    synthetic_results(tmp_path)
    ax = figure(load_results(tmp_path)).axes[0]
    assert 0.0 <= ax.get_xlim()[0] < 0.1 and 0.5 < ax.get_xlim()[1] < 0.6  # kept fractions 0.1 and 0.5
    assert ax.get_ylim()[1] <= 100 and "mean over 2 tasks, 2 samples each" in ax.get_title()
    assert "95% Wilson interval" in ax.get_title()


def test_report_command(tmp_path, capsys):
    synthetic_results(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "snapkv" in out and (tmp_path / "accuracy.png").exists()
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path / "m" / "passkey" / "nothing")])
    assert "RESULTS_DIR" in capsys.readouterr().err


def without(monkeypatch, *modules: str) -> None:
    """As on an install without the extras that bring `modules`: the checks that look for them find nothing."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else find(name, *a))


def test_report_writes_its_tables_without_matplotlib(tmp_path, capsys, monkeypatch):
    """Tables need pandas alone: without matplotlib the default plot is skipped with a one-line notice (exit 0);
    a plot asked for by name is refused before anything is read, naming the extra."""
    synthetic_results(tmp_path)
    without(monkeypatch, "matplotlib")
    assert main(["report", str(tmp_path), "--format", "md"]) == 0
    captured = capsys.readouterr()
    assert "| snapkv" in captured.out and not (tmp_path / "accuracy.png").exists()
    assert captured.err.strip() == (f"sparsekv: no plot drawn: pip install 'sparsekv[plot]' to draw "
                                    f"{tmp_path / 'accuracy.png'}.")
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path), "--plot", str(tmp_path / "p.png")])
    assert exit_.value.code == 2 and "needs matplotlib to draw plots: pip install 'sparsekv[plot]'" in \
        capsys.readouterr().err
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("command, modules, extras", [
    (["eval", "--model", "smollm2-135m"], ("pandas",), "eval"),
    (["eval", "--model", "smollm2-135m", "--tasks", "ruler:niah_single_1"], ("pandas", "datasets"), "eval"),
    (["eval", "--model", "smollm2-135m"], ("pandas", "gguf"), "eval,gguf"),
    (["demo"], ("gguf",), "gguf"),
    (["bench", "--model", "x.gguf", "--plot", "b.png"], ("matplotlib", "psutil"), "eval,plot"),
])
def test_a_command_checks_its_extras_before_any_work(command, modules, extras, monkeypatch, capsys):
    """A missing extra is found at the door, not after a sweep: nothing is loaded, and the one `pip install` that
    brings every missing module is named."""
    import sparsekv.models

    monkeypatch.setattr(sparsekv.models, "load_model", lambda *a, **kw: pytest.fail("work began"))
    without(monkeypatch, *modules)
    with pytest.raises(SystemExit) as exit_:
        main(command)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"pip install 'sparsekv[{extras}]'" in err, err
    assert all(module in err for module in modules), err


# --- end to end and bad input ----------------------------------------------------------------------------------
def test_eval_command_end_to_end(tmp_path, model_dir, capsys):
    out = tmp_path / "results"
    args = ["eval", "--model", str(model_dir), "--tasks", "niah_single,passkey", "--presses", "snapkv,streamingllm",
            "--ratios", "0.5", "--lengths", "200", "--samples", "2", "--mode", "both", "--max-new-tokens", "3",
            "--out", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "streamingllm" in table and "passkey" in table
    assert len(list(out.rglob("metrics.json"))) == 2 * (1 + 2 * 2)
    assert main(["report", str(out), "--plot", str(tmp_path / "p.png")]) == 0 and (tmp_path / "p.png").exists()


def test_device_map_auto_gives_the_same_answers(tmp_path, model_dir, monkeypatch):
    """`--device-map auto` (accelerate's dispatch; everything on the CPU here) answers as the plain load does."""
    import transformers

    from sparsekv.models import auto_device

    maps, load = [], transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: maps.append(kw.get("device_map")) or load(*a, **kw))
    runs = {}
    for name, extra in (("plain", []), ("auto", ["--device-map", "auto"])):
        out = tmp_path / name
        assert main(["eval", "--model", str(model_dir), "--tasks", "niah_single", "--presses", "snapkv",
                     "--ratios", "0.5", "--lengths", "200", "--samples", "2", "--max-new-tokens", "3",
                     "--out", str(out), *extra]) == 0
        runs[name] = sorted((path.relative_to(out).as_posix(), [json.loads(line)["prediction"] for line in
                             path.read_text().splitlines()]) for path in out.rglob("predictions.jsonl"))
    assert len(runs["auto"]) == 2 and runs["auto"] == runs["plain"]
    # The map really reached from_pretrained; a plain load goes to the auto device (the CPU here).
    assert maps == [auto_device(), "auto"]


@pytest.mark.parametrize("args, message", [
    (["--tasks", "niah_single,haystack"], "--tasks: unknown task 'haystack'; local tasks: niah_single"),
    (["--presses", "snapkv,pyramid"], "--presses: unknown press 'pyramid'; known presses: full, snapkv"),
    (["--model", "smollm3"], "--model: unknown model 'smollm3'; aliases: smollm2-135m, qwen2.5-0.5b"),
    (["--lengths", "9000"], "--lengths: 9000 exceeds the context of smollm2-135m"),
    (["--haystack", "/nonexistent/essay.txt"], "--haystack: cannot read"),
    (["--ratios", "1.5"], "--ratios: .*must be in"),
    (["--mode", "sideways"], "--mode: invalid choice"),
    (["--presses", "chunkkv:reuse_layers"], "--presses: 'chunkkv:reuse_layers': options are key=value after the name"),
    (["--presses", "chunkkv:reuse=1"],
     "--presses: 'chunkkv:reuse=1': ChunkPress has no option 'reuse'; its options: ratio, budget"),
    (["--presses", "full:x=1"], "--presses: the full cache takes no options"),
])
def test_bad_command_line_input(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["eval", "--out", str(tmp_path), *args])
    assert re.search(message, capsys.readouterr().err)


def test_press_options_after_the_name():
    from sparsekv import ChunkPress, SnapKVPress
    from sparsekv.evaluation import make_press

    assert make_press("chunkkv:reuse_layers=1:chunk_size=5", ratio=0.5) == ChunkPress(ratio=0.5, reuse_layers=1,
                                                                                       chunk_size=5)
    assert make_press("snapkv:pooling=avg", budget=64) == SnapKVPress(budget=64, pooling="avg")
    assert make_press("full") is None


def test_length_beyond_the_model_context(tmp_path, model, tokenizer):
    with pytest.raises(ValueError, match=r"--lengths: 1022 tokens \+ 3 generated exceeds the model's context \(1024"):
        Evaluator(config(tmp_path, lengths=[1022]), model, tokenizer)


def test_unreadable_haystack(tmp_path, model, tokenizer):
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(ValueError, match="--haystack: cannot read"):
        Evaluator(config(tmp_path, haystack=str(binary)), model, tokenizer)
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="has no text"):
        read_haystack(tmp_path / "empty.txt")


def test_length_too_short_for_a_task(tokenizer):
    with pytest.raises(ValueError, match="--lengths: 40 tokens is too short for task 'niah_single'"):
        TASKS["niah_single"].make(tokenizer, 40)


# --- Hub loaders (offline: the Hub is faked) --------------------------------------------------------------------
def test_hub_task_skipped_with_a_message_when_offline(tmp_path, model, tokenizer, monkeypatch, capsys):
    def offline(*args):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(hub, "_rows", offline)
    results = Evaluator(config(tmp_path, tasks=["ruler:niah_single_1", "niah_single"]), model, tokenizer).run_all()
    assert {m["task"] for m in results} == {"niah_single"}
    assert "skipping ruler:niah_single_1: cannot load it from the Hugging Face Hub" in capsys.readouterr().err


def test_hub_rows_become_samples(tmp_path, model, tokenizer, monkeypatch):
    rows = [{"context": "The sky is blue. " * n, "question": "What color is the sky?", "answer_prefix": "It is",
             "answer": ["blue"], "task": "qa_1", "max_new_tokens": 5} for n in (2, 500, 3)]
    monkeypatch.setattr(hub, "_rows", lambda *args: rows)
    samples, new_tokens = hub.load_hub_task("ruler:qa_1", 200, 5, tokenizer)
    assert len(samples) == 2 and new_tokens == 5  # the 500-sentence row does not fit in 200 tokens
    assert samples[0].metric == "any" and samples[0].answers == ["blue"]
    results = Evaluator(config(tmp_path, tasks=["ruler:qa_1"], max_new_tokens=None), model, tokenizer).run_all()
    assert results[0]["samples"] == 2 and results[0]["max_new_tokens"] == 5
    assert hub.is_hub_task("longbench:hotpotqa") and not hub.is_hub_task("ruler:")


# --- accelerate: two real CPU processes ------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("accelerate", path=os.path.dirname(sys.executable)) is None,
                    reason="accelerate launcher not installed")
def test_accelerate_launch_two_processes(tmp_path, model_dir):
    out = tmp_path / "results"
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    # On CPU, `--multi_gpu` is what starts several processes (torchrun); `--cpu` alone starts one (it expects MPI).
    cmd = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "-m", "sparsekv", "eval", "--model", str(model_dir), "--tasks", "passkey",
           "--presses", "snapkv", "--ratios", "0.5", "--lengths", "200", "--samples", "4", "--max-new-tokens", "2",
           "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    run = out / "tiny" / "passkey" / "snapkv_0.5_200_question"
    assert [p["process"] for p in read_predictions(run)] == [0, 0, 1, 1]
    assert json.loads((run / "metrics.json").read_text())["samples"] == 4
