"""`sparsekv bench`: what each press costs at prefill and saves at decoding, against two references.

For every prompt length L, greedy generations of exactly `max_new_tokens` tokens are timed with:

- the full cache on the L-token prompt ("full");
- each press keeping `ratio` of the prompt (or `budget` tokens);
- the *oracle* of that press: the full cache on a prompt as long as the press's budget (`round(ratio * L)` or
  `budget` tokens), i.e. what a perfect press keeping that many tokens would cost.

Prompts are suffixes of one needle-in-a-haystack prompt (`sparsekv.niah`), so every length is exact and the
question stays at the end. A logits processor stamps the time after every forward (`StepClock`):
prefill is the time to the first stamp, the decode latencies are the deltas between stamps. Each configuration
is warmed up once on a short prompt, the repeats are interleaved across configurations (so drift in machine
load hits all of them alike), and medians are reported. Peak memory is the process's resident set size above
its level before the run, sampled by a background thread (`ru_maxrss` only ever grows over a process's life,
so it cannot tell configurations apart), plus `torch.cuda.max_memory_allocated` on a GPU. KV tokens and bytes
are those of the cache at the end of the generation (`SparseCache.stats()`).
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import json
import math
import statistics
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from .cache import cache_footprint
from .environment import environment
from .evaluation.presses import check_press, known_presses, make_press
from .models import require
from .niah import build_needle_prompt
from .prefill import prefill_rows
from .table import format_table

WARMUP_TOKENS = 1024  # warm-up prompt length (at most the configuration's own)
WARMUP_NEW_TOKENS = 4


class StepClock(LogitsProcessor):
    """Records `time.perf_counter()` each time generate scores a next token, i.e. after every forward
    (on a GPU, once the forward is done)."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)
        self.stamps.append(time.perf_counter())
        return scores


def timed_generate(model, input_ids: torch.Tensor, max_new_tokens: int, **kwargs):
    """Greedy `generate`; returns `(output, seconds, step stamps)`, stamps relative to the start. The attention
    mask defaults to every token (give `attention_mask=` for a left-padded batch)."""
    clock = StepClock()
    mask = kwargs.pop("attention_mask", None)
    start = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids) if mask is None else mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        logits_processor=LogitsProcessorList([clock]),
        **kwargs,
    )
    return out, time.perf_counter() - start, [t - start for t in clock.stamps]


@dataclass(frozen=True)
class Setting:
    """One measured configuration: `press` ("full" or a press spec of the registry) on `batch` prompts of `length`
    tokens; `ragged`: their lengths spread evenly from `length` down to half of it (left-padded)."""

    press: str
    length: int
    ratio: float | None = None
    budget: int | None = None
    batch: int = 1
    ragged: bool = False

    @property
    def kept(self) -> int:
        """Prompt tokens the press keeps of the longest row: its budget, or `ratio` of the prompt (rounded as
        `Press.row_budgets`)."""
        if self.press == "full":
            return self.length
        return self.budget if self.budget is not None else max(1, round(self.ratio * self.length))

    def row_lengths(self) -> list[int]:
        """Each row's prompt length."""
        if not self.ragged or self.batch == 1:
            return [self.length] * self.batch
        return [round(self.length * (1 - 0.5 * i / (self.batch - 1))) for i in range(self.batch)]

    def oracle(self) -> Setting:
        """The full cache on prompts as long as what the press keeps of each row, at the same batch."""
        return Setting("full", self.kept, batch=self.batch, ragged=self.ragged and self.budget is None)

    def label(self, lengths) -> str:
        if self.press == "full":
            return "full" if self.length in lengths else "oracle"
        return f"{self.press} " + (f"b={self.budget}" if self.budget is not None else f"r={self.ratio:g}")

    def make_press(self, tokenizer=None):
        return None if self.press == "full" else make_press(self.press, self.ratio, self.budget, tokenizer)


def plan(lengths, presses, ratios=None, budgets=None, batch_sizes=(1,), ragged: bool = False
         ) -> list[tuple[Setting, Setting, Setting]]:
    """`(press, full cache at the same length and batch, oracle)` for every length x batch x press x ratio (or
    budget).

    Raises ValueError for unknown presses, budgets larger than a length and presses that refuse a budget.
    """
    kept = [(None, b) for b in budgets] if budgets else [(r, None) for r in ratios]
    triples = []
    for length, batch in itertools.product(lengths, batch_sizes):
        full = Setting("full", length, batch=batch, ragged=ragged)
        for name, (ratio, budget) in itertools.product([p for p in presses if p != "full"], kept):
            setting = Setting(name, length, ratio, budget, batch, ragged)  # the full cache is always measured
            if budget is not None and budget > min(setting.row_lengths()):
                raise ValueError(f"--budgets: {budget} exceeds the {min(setting.row_lengths())}-token prompt of "
                                 f"a row ({length} tokens{', ragged' if ragged else ''}).")
            try:
                check_press(name, ratio, budget)
            except ValueError as err:
                raise ValueError(f"{setting.label(lengths)}: {err}") from None
            triples.append((setting, full, setting.oracle()))
    if not triples:
        raise ValueError(f"--presses: give at least one press other than full; known presses: {known_presses()}.")
    return triples


def check_inputs(lengths, presses, ratios, budgets, max_new_tokens: int, repeats: int, context: int | None,
                 plot: str | None = None, json_path: str | None = None) -> None:
    """Raise ValueError with a clear message for any input the benchmark cannot run."""
    for name in presses:
        check_press(name)  # unknown names and options raise, listing the presses
    if (ratios is None) == (budgets is None):
        raise ValueError("give exactly one of --ratios and --budgets.")
    if ratios is not None and not (ratios and all(0 < r <= 1 for r in ratios)):
        raise ValueError(f"--ratios: each must be in (0, 1]; got {ratios}.")
    if budgets is not None and not (budgets and all(isinstance(b, int) and b >= 1 for b in budgets)):
        raise ValueError(f"--budgets: each must be an integer >= 1; got {budgets}.")
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths: give positive token counts; got {lengths}.")
    if max_new_tokens < 2:
        raise ValueError(f"--max-new-tokens: at least 2 (one decoding step); got {max_new_tokens}.")
    if repeats < 1:
        raise ValueError(f"--repeats: at least 1; got {repeats}.")
    if context is not None and max(lengths) + max_new_tokens > context:
        raise ValueError(f"--lengths: {max(lengths)} tokens + {max_new_tokens} generated exceeds the model's "
                         f"context ({context} tokens).")
    for option, path in (("--plot", plot), ("--json", json_path)):
        if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
            raise ValueError(f"{option}: the folder of {path} does not exist.")
    if plot is not None and Path(plot).suffix.lower() != ".png":
        raise ValueError(f"--plot: must be a .png file; got {plot}.")


# --- measuring ---------------------------------------------------------------------------------------------------
class PeakRSS:
    """Context manager: peak resident set size of this process above its level at entry, in `peak_mb`.

    A background thread samples `psutil.Process().memory_info().rss` every `interval` seconds (and once more at
    exit), so a peak shorter than `interval` can be missed.
    """

    def __init__(self, interval: float = 0.005):
        require("psutil", "eval", "to measure memory")
        import psutil

        self.interval, self._process = interval, psutil.Process()
        self.baseline = self.peak = 0

    def _rss(self) -> int:
        return self._process.memory_info().rss

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        self.baseline = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.baseline) / 2**20


def _release_memory() -> None:
    """Return freed memory to the system before a run, so its baseline does not hide memory it reuses."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed heap pages otherwise
    except (OSError, AttributeError):
        pass


def step_latencies(stamps: list[float]) -> list[float]:
    """Milliseconds of each decoding step from the per-step time stamps (seconds): one fewer than the stamps."""
    return [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]


# Steps below which a latency slope is noise, not growth: a few milliseconds of jitter over 16 steps reads as
# thousands of milliseconds per 1,000 tokens.
MIN_SLOPE_STEPS = 32


def slope_per_1k(latencies_ms: list[float]) -> float | None:
    """How much a decoding step's latency grows as the cache grows, in ms per 1,000 generated tokens: the median
    of the slopes between pairs of steps (Theil-Sen, over at most 256 evenly spaced steps), which a slow step or
    two does not swing as a least-squares fit does. None for fewer than `MIN_SLOPE_STEPS` steps."""
    n = len(latencies_ms)
    if n < MIN_SLOPE_STEPS:
        return None
    x = np.unique(np.linspace(0, n - 1, min(n, 256)).round().astype(int))
    y = np.asarray(latencies_ms, dtype=float)[x]
    i, j = np.triu_indices(len(x), 1)
    return 1000 * float(np.median((y[j] - y[i]) / (x[j] - x[i])))


def running_median(values: list[float], window: int = 16) -> list[float]:
    """Median of the `window` values ending at each index (of fewer at the start)."""
    return [statistics.median(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def measure(model, ids: torch.Tensor, press, max_new_tokens: int, pad_token_id=None, attention_mask=None,
            rows_apart: bool = False) -> dict:
    """One greedy generation of exactly `max_new_tokens` tokens with `press` (None: full cache); `rows_apart`:
    the prompts prefilled one row at a time and joined (`prefill_rows`), then decoded together.

    Returns prefill seconds, the decode latency of every step (ms), peak memory above the pre-run level (MB;
    CUDA: None off the GPU), the final cache's resident and attended tokens and KV bytes, and the press's own
    work from `cache.seconds`: seconds compressing the prompt, and ms per decoding step (None without a press),
    and the mean `layer_jaccard` of the kept tokens (how alike adjacent layers' selections are).
    """
    _release_memory()
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats(ids.device)
        gpu_base = torch.cuda.memory_allocated(ids.device)
    with PeakRSS() as rss, press(model) if press is not None else nullcontext():
        start, kwargs = time.perf_counter(), {}
        if rows_apart:
            kwargs["cache"] = prefill_rows(model, ids, attention_mask)
        apart_s = time.perf_counter() - start
        out, _, stamps = timed_generate(model, ids, max_new_tokens, min_new_tokens=max_new_tokens,
                                        pad_token_id=pad_token_id, attention_mask=attention_mask, **kwargs)
    resident, attended, kv_bytes = cache_footprint(out.cache)
    steps = step_latencies(stamps)
    seconds = dict(getattr(out.cache, "seconds", {}))  # press work, a SparseCache only
    jaccard = out.cache.stats().layer_jaccard if hasattr(out.cache, "stats") else []
    return {
        "prefill_s": apart_s + stamps[0],
        "steps_ms": steps,
        "compress_s": seconds.pop("compress", None),
        "press_ms": sum(seconds.values()) * 1000 / max(len(steps), 1) if press is not None else None,
        "jaccard": statistics.mean(jaccard) if jaccard else None,
        "peak_mb": rss.peak_mb,
        "cuda_peak_mb": (torch.cuda.max_memory_allocated(ids.device) - gpu_base) / 2**20 if cuda else None,
        "resident": resident,
        "attended": attended,
        "kv_bytes": kv_bytes,
    }


# --- summary -----------------------------------------------------------------------------------------------------
def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def medians(runs: list[dict]) -> dict:
    """Medians over the repeats of one configuration. `decode_ms` is the median of each run's median step;
    `curve` the median latency at each step, `slope` its linear fit (ms per 1,000 generated tokens)."""
    curve = [statistics.median(step) for step in zip(*(r["steps_ms"] for r in runs))]
    return {
        "prefill_s": _median(r["prefill_s"] for r in runs),
        "compress_s": _median(r.get("compress_s") for r in runs),
        "decode_ms": _median(statistics.median(r["steps_ms"]) for r in runs),
        "press_ms": _median(r.get("press_ms") for r in runs),
        "jaccard": _median(r.get("jaccard") for r in runs),
        "slope": slope_per_1k(curve),
        "peak_mb": _median(r["peak_mb"] for r in runs),
        "cuda_peak_mb": _median(r["cuda_peak_mb"] for r in runs),
        "resident": _median(r["resident"] for r in runs),
        "attended": _median(r["attended"] for r in runs),
        "kv_mb": _median(r["kv_bytes"] for r in runs) / 2**20,
        "curve": curve,
    }


def summarize(runs: dict[Setting, list[dict]], triples, lengths) -> list[dict]:
    """One row per configuration (in `runs`' order): medians, decoding throughput (`tok_s`, tokens per second
    over the batch), and for presses the ratios to the full cache at the same length and batch (`*_vs_full`)
    and to the oracle (`*_vs_oracle`)."""
    med = {setting: medians(r) for setting, r in runs.items()}
    for setting, m in med.items():  # decoding throughput: every row of the batch gains a token per step
        m["tok_s"] = setting.batch * 1000 / m["decode_ms"] if m["decode_ms"] else None
    refs = {press: (full, oracle) for press, full, oracle in triples}
    rows = []
    for setting, m in med.items():
        row = {"config": setting.label(lengths), "press": setting.press, "ratio": setting.ratio,
               "budget": setting.budget, "length": setting.length, "kept": setting.kept, "batch": setting.batch,
               "ragged": setting.ragged, **m}
        full, oracle = refs.get(setting, (None, None))
        for metric in ("prefill_s", "decode_ms", "tok_s", "peak_mb", "cuda_peak_mb", "kv_mb"):
            name = metric.rsplit("_", 1)[0]
            row[f"{name}_vs_full"] = _ratio(m[metric], med[full][metric]) if full else None
            row[f"{name}_vs_oracle"] = _ratio(m[metric], med[oracle][metric]) if oracle else None
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    """The benchmark's table, within 120 columns: /oracle is the decode step against the oracle's, /full the
    tokens/s against the full cache's; held and read are KV tokens per sequence (held, and attended per step);
    ms/1k tok is how much a step slows per 1,000 generated tokens (`slope_per_1k`; runs of 32 steps or more). The
    GPU column only when measured; the JSON (`--json`) has every measure (compress time, layer Jaccard, ...)."""
    columns = [
        ("config", "config", ""), ("length", "length", "d"), ("batch", "batch", "d"),
        ("prefill s", "prefill_s", ".2f"), ("decode ms/tok", "decode_ms", ".2f"),
        ("/oracle", "decode_vs_oracle", ".2f"), ("tok/s", "tok_s", ".1f"), ("/full", "tok_vs_full", ".2f"),
        ("peak MB", "peak_mb", ".0f"), ("GPU peak MB", "cuda_peak_mb", ".0f"), ("KV MB", "kv_mb", ".1f"),
        ("held tok", "resident", ".0f"), ("read tok", "attended", ".0f"), ("ms/1k tok", "slope", ".2f"),
    ]
    for optional in ("cuda_peak_mb", "slope"):
        if all(row[optional] is None for row in rows):
            columns = [c for c in columns if c[1] != optional]
    return format_table(rows, columns)


def plot_latency(rows: list[dict], path, title: str = "", window: int = 16) -> Path:
    """PNG of decode latency (ms, running median of `window` steps) vs generated token, a line per row."""
    require("matplotlib", "plot", "to draw plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for row in rows:
        ax.plot(range(1, len(row["curve"]) + 1), running_median(row["curve"], window),
                label=f"{row['config']} ({row['length']} tok)", linestyle="--" if row["press"] == "full" else "-")
    ax.set_xlabel("generated token")
    ax.set_ylabel(f"decode latency, ms (running median of {window})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_throughput(rows: list[dict], path, title: str = "") -> Path:
    """PNG of decoding throughput (tokens/s over the batch) against batch size: a line per configuration and
    length (the full cache dashed, oracles dotted)."""
    require("matplotlib", "plot", "to draw plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lines: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for row in rows:
        lines.setdefault((row["config"], row["length"]), []).append((row["batch"], row["tok_s"]))
    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for (config, length), points in lines.items():
        xs, ys = zip(*sorted(points))
        style = {"full": "--", "oracle": ":"}.get(config, "-")
        ax.plot(xs, ys, marker="o", linestyle=style, label=f"{config} ({length} tok)")
    ax.set(xlabel="batch size", ylabel="decoding throughput, tokens/s", title=title)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({row["batch"] for row in rows}), labels=[str(b) for b in sorted({row["batch"] for row in rows})])
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


# --- the benchmark -----------------------------------------------------------------------------------------------
def batch_inputs(source: torch.Tensor, row_lengths: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, attention_mask)`: row i is the last `row_lengths[i]` tokens of `source` `(1, L)`, left-padded."""
    width = max(row_lengths)
    ids = torch.full((len(row_lengths), width), pad_id, dtype=source.dtype, device=source.device)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(row_lengths):
        ids[i, width - n:], mask[i, width - n:] = source[0, -n:], 1
    return ids, mask


def run_bench(model, tokenizer, lengths, presses=("snapkv", "h2o", "streamingllm"), ratios=None, budgets=None,
              max_new_tokens: int = 64, repeats: int = 3, plot=None, json_path=None, title: str = "",
              batch_sizes=(1,), ragged: bool = False, rows_apart: bool = False) -> list[dict]:
    """Measure every configuration (warm-up, then `repeats` interleaved runs); return the summary rows.

    `ratios` defaults to `[0.1]` unless `budgets` is given. Every configuration runs at each of `batch_sizes`
    (`ragged`: rows of different lengths, see `Setting`; `rows_apart`: prefilled one row at a time and joined).
    Writes the latency plot to `plot` (and, with several batch sizes, the throughput plot beside it,
    `*_throughput.png`) and the rows (with their per-step latency curves) to `json_path` when given. Invalid
    inputs raise ValueError before any run.
    """
    ratios = [0.1] if ratios is None and budgets is None else ratios
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    check_inputs(lengths, presses, ratios, budgets, max_new_tokens, repeats, limit, plot, json_path)
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"--batch-sizes: give integers >= 1; got {list(batch_sizes)}.")
    triples = plan(lengths, presses, ratios, budgets, batch_sizes, ragged)
    settings = list(dict.fromkeys(s for triple in triples for s in (triple[1], triple[2], triple[0])))
    if rows_apart:
        check_rows_apart(settings, tokenizer, lengths)

    longest = max(s.length for s in settings)
    source, _ = build_needle_prompt(tokenizer, math.ceil(1.03 * longest) + 16)
    if source.shape[1] < longest:
        raise ValueError(f"the tokenizer made a {source.shape[1]}-token prompt; {longest} tokens are needed.")
    source = source.to(model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(setting: Setting, length: int, new_tokens: int) -> dict:
        rows = [max(1, round(n * length / setting.length)) for n in setting.row_lengths()]  # scaled for warm-ups
        ids, mask = batch_inputs(source, rows, pad)
        return measure(model, ids, setting.make_press(tokenizer), new_tokens, pad, mask, rows_apart)

    # Every code path once, on a short prompt the press accepts; presses first: a budget they refuse fails fast.
    for s in tqdm(sorted(settings, key=lambda s: s.press == "full"), desc="warm-up"):
        floor = s.budget if s.budget is not None else (math.ceil(128 / s.ratio) if s.ratio else 0)
        try:
            run(s, min(s.length, max(WARMUP_TOKENS, floor)), WARMUP_NEW_TOKENS)
        except ValueError as err:
            raise ValueError(f"{s.label(lengths)} at {s.length} tokens: {err}") from None
    runs = {s: [] for s in settings}
    with tqdm(total=repeats * len(settings), desc="measuring") as bar:
        for _ in range(repeats):  # interleaved: drift in machine load hits every configuration alike
            for s in settings:
                runs[s].append(run(s, s.length, max_new_tokens))
                bar.update()

    rows = summarize(runs, triples, lengths)
    if plot:
        plot_latency(rows, plot, title)
        if len(batch_sizes) > 1:
            plot_throughput(rows, Path(plot).with_name(Path(plot).stem + "_throughput.png"), title)
    if json_path:
        meta = {"title": title, "threads": torch.get_num_threads(), "device": str(model.device),
                "batch_sizes": list(batch_sizes), "ragged": ragged, "rows_apart": rows_apart,
                "max_new_tokens": max_new_tokens, "repeats": repeats, "dtype": str(model.dtype).removeprefix("torch."),
                "attn_implementation": model.config._attn_implementation, "environment": environment(model.device)}
        Path(json_path).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return rows


def check_rows_apart(settings, tokenizer, lengths) -> None:
    """`--rows-apart` needs presses whose caches join (`Press.joins_rows`): refuse the others before any run."""
    refused = sorted({s.label(lengths) for s in settings
                      if s.press != "full" and not s.make_press(tokenizer).joins_rows})
    if refused:
        raise ValueError(f"--rows-apart: {', '.join(refused)} cannot join rows prefilled apart (CHESS's store "
                         "records every token by position); leave them out, or run without --rows-apart.")


# --- capacity: the largest batch within a memory budget -------------------------------------------------------------
def model_mb(model) -> float:
    """Megabytes of the model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def run_capacity(model, tokenizer, lengths, presses, ratios=None, budgets=None, memory_budget_gb: float = 8.0,
                 max_batch: int = 64, max_new_tokens: int = 16, rows_apart: bool = False,
                 exact: bool = False) -> list[dict]:
    """For the full cache, each press and its oracle at each length: the largest batch (1, 2, 4, ... up to
    `max_batch`) whose measured memory fits `memory_budget_gb`, and its decoding tokens/s. `rows_apart`: every
    configuration's prompts prefilled one row at a time and joined (`prefill_rows`), so that the batch is capped by
    what decoding holds, not by a batch's prefill. `exact`: then bisect between the last batch that fit and the
    first that did not, or `max_batch` (about log2(batch) more runs), so that 9 is found where 8 fit and 16 did
    not.

    Memory is the model's weights plus the run's peak above its start: the process's resident set on a CPU,
    `torch.cuda.max_memory_allocated` on a GPU. Each batch size is measured once; the search stops at the first
    that does not fit. A configuration whose batch of 1 does not fit gets batch 0.
    """
    ratios = [0.1] if ratios is None and budgets is None else ratios
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    check_inputs(lengths, presses, ratios, budgets, max_new_tokens, 1, limit)
    if not memory_budget_gb > 0:
        raise ValueError(f"--memory-budget: must be a positive number of GB; got {memory_budget_gb}.")
    settings = list(dict.fromkeys(s for triple in plan(lengths, presses, ratios, budgets) for s in triple[1:] + triple[:1]))
    if rows_apart:
        check_rows_apart(settings, tokenizer, lengths)
    source, _ = build_needle_prompt(tokenizer, math.ceil(1.03 * max(lengths)) + 16)
    source = source.to(model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    weights, budget_mb = model_mb(model), memory_budget_gb * 1024
    rows = []
    for base in tqdm(settings, desc="capacity"):

        def fits(batch: int) -> dict | None:
            """The run of `batch` rows: its memory and tokens/s, or None when it exceeds the budget."""
            setting = Setting(base.press, base.length, base.ratio, base.budget, batch)
            ids, mask = batch_inputs(source, setting.row_lengths(), pad)
            run = measure(model, ids, setting.make_press(tokenizer), max_new_tokens, pad, mask, rows_apart)
            memory = weights + (run["cuda_peak_mb"] if run["cuda_peak_mb"] is not None else run["peak_mb"])
            if memory > budget_mb:
                return None
            return {"batch": batch, "memory_mb": memory, "tok_s": batch * 1000 / statistics.median(run["steps_ms"])}

        best, batch = None, 1
        while batch <= max_batch and (run := fits(batch)) is not None:
            best, batch = run, batch * 2
        capped = best is not None and batch > max_batch
        if exact and best is not None:  # between what fit and what did not (or `max_batch`, not tried yet)
            low, high = best["batch"], max_batch + 1 if capped else batch
            while high - low > 1:
                middle = (low + high) // 2
                if (run := fits(middle)) is not None:
                    best, low = run, middle
                else:
                    high = middle
            capped = best["batch"] == max_batch
        rows.append({"config": base.label(lengths), "length": base.length, "kept": base.kept,
                     "batch": best["batch"] if best else 0, "capped": capped,
                     "memory_mb": best["memory_mb"] if best else None, "tok_s": best["tok_s"] if best else None})
    return rows


def format_capacity(rows: list[dict], memory_budget_gb: float) -> str:
    for row in rows:
        row["largest batch"] = f"{row['batch']}{'+' if row['capped'] else ''}"
    columns = [("config", "config", ""), ("length", "length", "d"), ("KV kept tok", "kept", "d"),
               (f"largest batch in {memory_budget_gb:g} GB", "largest batch", ""),
               ("its memory MB", "memory_mb", ".0f"), ("its tok/s", "tok_s", ".1f")]
    return format_table(rows, columns)
