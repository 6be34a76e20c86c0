"""Measuring one generation: the time of each step (`StepClock`), the peak memory (`PeakRSS`), and medians over
repeats."""

from __future__ import annotations

import ctypes
import gc
import statistics
import threading
import time
from contextlib import nullcontext

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ..models import require
from ..prefill import prefill_rows
from ..stats import cache_footprint

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
