"""Running a sweep: tasks x presses x ratios (or budgets) x lengths x modes, on one model loaded once.

Each run writes `OUT/<model>/<task>/<press>_<ratio|bBUDGET>_<length>_<mode>/`: `config.json`, then one line per
sample in `predictions.jsonl` (reply, score, error if any), then `metrics.json`. A run whose `metrics.json`
exists is skipped, and samples already answered are not redone, so an interrupted sweep resumes where it stopped.

Modes: "question" feeds context + question to `generate` (the press compresses both); "agnostic" compresses
the context alone, then answers the question from the compressed cache. The full cache does not depend on the
mode: it runs once, in "question" mode, as the reference of both.

The runs of one task and length go sample by sample: each prompt is run through the model once
(`sparsekv.prefill.Prefill`) and every press of the sweep compresses that recorded forward and decodes from it,
with the same answers as `generate` under each press and one prompt forward per sample instead of one per run.

Under `accelerate launch`, each process answers its share of every run's samples into its own shard
(`predictions.rank<i>.jsonl`); process 0 merges the shards once all are done. On CPUs, start the processes with
`accelerate launch --multi_gpu --num_processes 2 -m sparsekv eval ...` (torchrun underneath; `--cpu` alone starts
one process, as it expects MPI) or `torchrun --nproc_per_node 2 -m sparsekv eval ...`.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..attention import module_implementation
from ..environment import environment
from ..models import MODELS, auto_device, require, sha256_file
from ..prefill import Prefill, generate_from
from ..stats import cache_footprint
from .hub import is_hub_task, load_hub_task
from .presses import check_press, is_full, make_press, press_options
from .prompts import Prompt, Sample, encode
from .results import check_identity, merge, open_shard, read_records, write_json
from .scoring import score
from .ruler import RULER_TASKS, UNSHIPPED
from .tasks import TASKS, read_haystack

MODES = ("question", "agnostic", "both")


@dataclass(frozen=True)
class Run:
    """One point of the sweep."""

    task: str
    press: str
    ratio: float | None
    budget: int | None
    length: int
    mode: str

    @property
    def name(self) -> str:
        kept = f"b{self.budget}" if self.budget is not None else f"{self.ratio:g}"
        return f"{self.press}_{kept}_{self.length}_{self.mode}"


@dataclass
class EvalConfig:
    """What `sparsekv eval` sweeps; every option of the command. Invalid values raise ValueError."""

    model: str = "smollm2-135m"
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    presses: list[str] = field(default_factory=lambda: ["snapkv", "h2o", "streamingllm"])
    ratios: list[float] = field(default_factory=lambda: [0.5, 0.25, 0.1])
    budgets: list[int] | None = None  # when given, replaces `ratios`
    lengths: list[int] = field(default_factory=lambda: [4096])
    samples: int = 20
    mode: str = "question"  # "question", "agnostic" or "both"
    out: str = "results"
    seed: int = 0
    max_new_tokens: int | None = None  # None: each task's own
    haystack: str | None = None
    full: bool = True  # include the full-cache reference

    def __post_init__(self):
        # "ruler": RULER's configuration, the tasks kvpress's leaderboard averages (less the two it downloads)
        self.tasks = [name for task in self.tasks for name in (list(RULER_TASKS) if task == "ruler" else [task])]
        for task in self.tasks:
            if task in UNSHIPPED:
                raise ValueError(f"--tasks: {task} is RULER's question answering over {UNSHIPPED[task]}, a dataset "
                                 f"sparsekv cannot generate; ruler:{task} loads it where the Hugging Face Hub is "
                                 "reachable.")
            if task not in TASKS and not is_hub_task(task):
                raise ValueError(f"--tasks: unknown task {task!r}; local tasks: {', '.join(TASKS)}; "
                                 "Hub tasks: ruler:<task>, longbench:<task>.")
        for press in self.presses:
            check_press(press)  # raises for unknown names and options
        if self.mode not in MODES:
            raise ValueError(f"--mode: must be one of {', '.join(MODES)}; got {self.mode!r}.")
        if not self.budgets and not all(isinstance(r, (int, float)) and 0 < r <= 1 for r in self.ratios):
            raise ValueError(f"--ratios: each must be in (0, 1]; got {self.ratios}.")
        if self.budgets and not all(isinstance(b, int) and b >= 1 for b in self.budgets):
            raise ValueError(f"--budgets: each must be an integer >= 1; got {self.budgets}.")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"--lengths: give positive token counts; got {self.lengths}.")
        if self.samples < 1:
            raise ValueError(f"--samples: must be at least 1; got {self.samples}.")

    def runs(self) -> list[Run]:
        """Every run of the sweep, the full-cache reference first for each task and length."""
        modes = ["question", "agnostic"] if self.mode == "both" else [self.mode]
        kept = [(None, b) for b in self.budgets] if self.budgets else [(r, None) for r in self.ratios]
        compressed = [p for p in self.presses if not is_full(p)]
        runs = []
        for length in self.lengths:
            for task in self.tasks:
                if self.full or "full" in self.presses:
                    runs.append(Run(task, "full", 1.0, None, length, "question"))
                runs += [Run(task, p, r, b, length, m) for p in compressed for r, b in kept for m in modes]
        return runs


class _SingleProcess:
    """The `accelerate.PartialState` interface for one process (used when accelerate is not wanted)."""

    process_index, num_processes, is_main_process = 0, 1, True

    def wait_for_everyone(self):
        pass

    def split_between_processes(self, items):
        return nullcontext(items)


def model_slug(name: str) -> str:
    """A folder name for a model: the alias, a local file's stem / folder's name, or a Hub id with `__`."""
    path = Path(name).expanduser()
    if name not in MODELS and path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return name.replace("/", "__")


def run_directory(config: EvalConfig, run: Run) -> Path:
    """`OUT/<model>/<task>/<run name>`."""
    return Path(config.out) / model_slug(config.model) / run.task.replace(":", "_") / run.name


def model_sha256(name: str) -> str | None:
    """The sha256 of the model's weights when known without a download: an alias's, or a local file's."""
    if name in MODELS:
        return MODELS[name].sha256
    path = Path(name).expanduser()
    return file_sha256(path) if path.is_file() else None


def file_sha256(path: Path) -> str:
    """A file's sha256, computed once per file version (path, size, modification time)."""
    stat = path.stat()
    return _file_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime: int) -> str:
    return sha256_file(Path(path))


def run_identity(config: EvalConfig, run: Run, dtype, attn_implementation: str, device: str) -> dict:
    """Everything that decides a run's results: a stored run is reused only when all of it matches."""
    haystack = Path(config.haystack) if config.haystack else None
    return {
        "model": model_slug(config.model), "model_source": config.model, "model_sha256": model_sha256(config.model),
        **asdict(run), "press_options": press_options(run.press, run.ratio, run.budget),
        "samples": config.samples, "seed": config.seed, "max_new_tokens": config.max_new_tokens,
        "haystack_sha256": file_sha256(haystack) if haystack else None,
        "dtype": str(dtype).removeprefix("torch."), "attn_implementation": attn_implementation, "device": device,
    }


def check_model_name(name: str) -> None:
    """Raise ValueError unless `name` is an alias, an existing path or a Hub id (`org/name`)."""
    if name not in MODELS and not Path(name).expanduser().exists() and "/" not in name:
        raise ValueError(f"--model: unknown model {name!r}; aliases: {', '.join(MODELS)}; "
                         "or a local .gguf file or model folder, or a Hub id such as org/name.")


def context_limit(model) -> int | None:
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None)


def answer(model, tokenizer, press, prompt: Prompt, mode: str, new_tokens: int,
           prefill: Prefill | None = None) -> tuple[str, dict]:
    """The model's greedy reply to one prompt, with `press` (None: full cache) in `mode`, and what the cache held
    when the reply was done: `{"kv_fraction": resident tokens, "attended_fraction": attended tokens}`, each over
    the tokens seen and averaged over layers (measured, so CHESS's store counts: it keeps every token).

    `prefill` is the prompt's recorded forward (of `prompt.ids` in "question" mode, of `prompt.context_ids` in
    "agnostic" mode), shared by every press answering the same prompt; made here when not given.
    """
    generation = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=model.generation_config.eos_token_id)
    ids = prompt.ids.to(model.device)
    if press is None:
        out = (prefill or Prefill.run(model, ids)).generate(None, generation)
        held = {"kv_fraction": 1.0, "attended_fraction": 1.0}
    else:
        prefill = prefill or Prefill.run(model, (prompt.context_ids if mode == "agnostic" else ids).to(model.device))
        cache = prefill.compress(press)
        if mode == "agnostic":  # the context compressed alone, then the question read from it
            out = generate_from(model, press, cache, ids, generation, copy_cache=False)
        else:
            out = prefill.generate(press, generation, cache=cache)
        resident, attended, _ = cache_footprint(cache)
        seen = cache.get_seq_length()
        held = {"kv_fraction": resident / seen, "attended_fraction": attended / seen}
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), held


def local_samples(task: str, tokenizer, length: int, n: int, seed: int, haystack: list[str] | None = None) -> list:
    """The `n` samples of a local task (`TASKS`) at `length` tokens that a sweep with `seed` answers: sample `i`
    has seed `seed * 100_000 + i` and its needle at depth `i / (n - 1)` (swept evenly, ends included)."""
    depths = [i / (n - 1) if n > 1 else 0.5 for i in range(n)]
    return [TASKS[task].make(tokenizer, length, seed * 100_000 + i, d, haystack) for i, d in enumerate(depths)]


class Evaluator:
    """Runs an `EvalConfig`'s sweep on a loaded model; `state` is an `accelerate.PartialState` (or alike)."""

    def __init__(self, config: EvalConfig, model, tokenizer, state=None):
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.state = state or _SingleProcess()
        self.haystack = read_haystack(config.haystack) if config.haystack else None
        self._samples: dict[tuple[str, int], tuple[list[Sample], list[Prompt], int] | None] = {}
        limit = context_limit(model)
        for length in config.lengths:
            longest = max(self.new_tokens(t) for t in config.tasks)
            if limit is not None and length + longest > limit:
                raise ValueError(f"--lengths: {length} tokens + {longest} generated exceeds the model's context "
                                 f"({limit} tokens).")

    def new_tokens(self, task: str, default: int = 64) -> int:
        return self.config.max_new_tokens or (TASKS[task].max_new_tokens if task in TASKS else default)

    def samples(self, task: str, length: int):
        """`(samples, prompts, new tokens)` of a task at a length, made once; None when a Hub task is skipped."""
        key = (task, length)
        if key not in self._samples:
            n, seed = self.config.samples, self.config.seed
            if task in TASKS:
                samples = local_samples(task, self.tokenizer, length, n, seed, self.haystack)
                self._samples[key] = (samples, [encode(self.tokenizer, s) for s in samples], self.new_tokens(task))
            else:
                loaded = load_hub_task(task, length, n, self.tokenizer)
                if loaded is not None:
                    samples, hub_tokens = loaded
                    prompts = [encode(self.tokenizer, s) for s in samples]
                    loaded = (samples, prompts, self.config.max_new_tokens or hub_tokens)
                self._samples[key] = loaded
        return self._samples[key]

    def directory(self, run: Run) -> Path:
        return run_directory(self.config, run)

    def identity(self, run: Run) -> dict:
        model = self.model
        return run_identity(self.config, run, model.dtype, module_implementation(model), str(model.device))

    def run_config(self, run: Run, n_samples: int, new_tokens: int) -> dict:
        c, identity = self.config, self.identity(run)
        return {"model": model_slug(c.model), "model_source": c.model, **asdict(run), "samples": n_samples,
                "seed": c.seed, "max_new_tokens": new_tokens, "haystack": c.haystack,
                "haystack_sha256": identity["haystack_sha256"], "identity": identity,
                "environment": environment(self.model.device)}

    def run_all(self) -> list[dict]:
        """Every run of the sweep (done ones read back); returns their metrics, in `config.runs()` order."""
        groups: dict[tuple[str, int], list[Run]] = {}
        for run in self.config.runs():
            groups.setdefault((run.task, run.length), []).append(run)
        metrics = {}
        for runs in groups.values():
            metrics.update(self.run_group(runs))
        return [metrics[run] for run in self.config.runs() if run in metrics]

    def run_group(self, runs: list[Run]) -> dict[Run, dict]:
        """The runs of one task and length, resumed if interrupted: each sample's prompt is run through the
        model once and every run's press answers from that one prefill. Returns metrics on the main process."""
        for run in runs:  # a stored run, finished or not, is reused only when made with these settings
            check_identity(self.directory(run), self.identity(run))
        pending = [run for run in runs if not (self.directory(run) / "metrics.json").exists()]
        finished = {} if not self.state.is_main_process else {
            run: json.loads((self.directory(run) / "metrics.json").read_text()) for run in runs if run not in pending}
        loaded = self.samples(runs[0].task, runs[0].length) if pending else None
        if loaded is None:
            return finished
        samples, prompts, new_tokens = loaded
        configs, done, presses = {}, {}, {}
        for run in pending:
            directory = self.directory(run)
            configs[run] = self.run_config(run, len(samples), new_tokens)
            directory.mkdir(parents=True, exist_ok=True)
            if self.state.is_main_process:
                write_json(directory / "config.json", configs[run])
            done[run] = read_records(directory)
            try:
                presses[run] = (make_press(run.press, run.ratio, run.budget, self.tokenizer), None)
            except ValueError as err:  # e.g. a budget below SnapKV's window: every sample of the run fails
                presses[run] = (None, str(err))
        with self.state.split_between_processes(list(range(len(samples)))) as mine, ExitStack() as stack:
            shard = f"predictions.rank{self.state.process_index}.jsonl"
            shards = {run: stack.enter_context(open_shard(self.directory(run) / shard)) for run in pending}
            todo = [i for i in mine if any(i not in done[run] for run in pending)]
            task, length = runs[0].task, runs[0].length
            bar = tqdm(todo, desc=f"{task} {length} ({len(pending)} runs)",
                       disable=not self.state.is_main_process or not todo)
            for i in bar:
                prefills = {}  # one recorded forward per sample and mode, shared by every press
                for run in pending:
                    if i in done[run]:
                        continue
                    press, error = presses[run]
                    mode = run.mode if press is not None else "question"
                    if error is None and mode not in prefills:
                        ids = prompts[i].context_ids if mode == "agnostic" else prompts[i].ids
                        prefills[mode] = Prefill.run(self.model, ids.to(self.model.device))
                    record = self.predict(press, run, samples[i], prompts[i], new_tokens, error, prefills.get(mode))
                    shards[run].write(json.dumps({"index": i, "process": self.state.process_index, **record}) + "\n")
                    shards[run].flush()
        self.state.wait_for_everyone()
        if not self.state.is_main_process:
            return {}
        return {**finished, **{run: merge(self.directory(run), configs[run]) for run in pending}}

    def predict(self, press, run: Run, sample: Sample, prompt: Prompt, new_tokens: int, error: str | None = None,
                prefill: Prefill | None = None):
        """One sample's record: reply, score, fraction of KV kept, and the press's error if it could not run."""
        compressed = prompt.context_ids.shape[1] if run.mode == "agnostic" else len(prompt)
        kept = run.ratio if run.budget is None else min(1.0, run.budget / compressed)
        record = {"depth": sample.depth, "answers": sample.answers, "metric": sample.metric,
                  "prompt_tokens": len(prompt)}
        try:
            if error is not None:
                raise ValueError(error)
            reply, held = answer(self.model, self.tokenizer, press, prompt, run.mode, new_tokens, prefill)
        except ValueError as err:  # e.g. a budget below what the press keeps: counted wrong, the sweep goes on
            # Nothing was held: the nominal share stands in, so the row still has a place on the plot.
            return {**record, "kv_fraction": kept, "attended_fraction": kept, "prediction": "", "score": 0.0,
                    "error": str(err)}
        return {**record, **held, "prediction": reply, "score": score(reply, sample.answers, sample.metric)}


def load_and_evaluate(config: EvalConfig, device_map=None, dtype=torch.float32, attn_implementation="sdpa",
                      distributed: bool = True) -> list[dict]:
    """Load the model once and run the sweep; with `distributed`, samples are split over accelerate processes.

    `device_map`: a device ("cpu", "cuda:0"), an accelerate map ("auto", or a dict), or None: each accelerate
    process's own device, or with one process CUDA when available, else the CPU."""
    from ..models import load_model

    check_model_name(config.model)
    done = [run_directory(config, run) / "metrics.json" for run in config.runs()]
    if isinstance(device_map, dict) and list(device_map) == [""]:
        device_map = device_map[""]
    # One device (None: the one there is, CUDA when available), or a map spreading the model (device unknown).
    device = auto_device() if device_map is None else str(torch.device(device_map)) if isinstance(
        device_map, (str, torch.device)) and device_map not in ("auto", "balanced", "sequential") else None
    if device is not None and all(path.exists() for path in done):  # a finished sweep: nothing to load
        for run in config.runs():
            check_identity(run_directory(config, run), run_identity(config, run, dtype, attn_implementation, device))
        return [json.loads(path.read_text()) for path in done]
    state = None
    if distributed:
        require("accelerate", "eval", "to split a sweep over processes")
        from accelerate import PartialState

        # Processes on CPU (no accelerator, or `--cpu`) only join a process group when told they are on CPU.
        accelerator = getattr(torch, "accelerator", torch.cuda)
        on_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") or not accelerator.is_available()
        state = PartialState(cpu=on_cpu)
    if device_map is None:  # several processes: each its own device; else the one device found above
        device_map = state.device if state is not None and state.num_processes > 1 else device
    model, tokenizer = load_model(config.model, dtype=dtype, attn_implementation=attn_implementation,
                                  device_map=device_map)
    return Evaluator(config, model, tokenizer, state).run_all()
