"""Running the benchmark: every configuration timed with interleaved repeats (`run_bench`), or the largest batch
each fits in a memory budget (`run_capacity`)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..attention import module_implementation
from ..environment import environment
from ..niah import build_needle_prompt
from .timing import measure
from .report import plot_latency, plot_throughput, summarize
from .settings import Setting, batch_inputs, check_inputs, check_rows_apart, sweep

WARMUP_TOKENS = 1024  # warm-up prompt length (at most the configuration's own)


WARMUP_NEW_TOKENS = 4


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
    triples = sweep(lengths, presses, ratios, budgets, batch_sizes, ragged)
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
                "attn_implementation": module_implementation(model),
                "environment": environment(model.device)}
        Path(json_path).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return rows


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
    triples = sweep(lengths, presses, ratios, budgets)
    settings = list(dict.fromkeys(s for triple in triples for s in triple[1:] + triple[:1]))
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
