"""`sparsekv report`: the results of `sparsekv eval` as a table and a plot.

The table has one row per model, length, mode, press and amount kept, one column per task (scores in %),
their mean (only when every task of the table has a score: a missing task is shown as missing, never averaged
away), and the number of samples the press could not run (counted wrong). The plot shows, per model and
length, the mean score against the fraction of the KV cache kept, with its 95% Wilson interval over the pooled
samples: one line per press (dashed for question-agnostic runs), the full cache as a horizontal band.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections import defaultdict
from pathlib import Path

from ..models import require
from ..table import format_table


def load_results(directory: str | Path) -> list[dict]:
    """The metrics of every finished run under `directory`; raises ValueError when there are none."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"RESULTS_DIR: {str(root)!r} is not a folder.")
    results = [json.loads(path.read_text()) for path in sorted(root.rglob("metrics.json"))]
    if not results:
        raise ValueError(f"RESULTS_DIR: no finished run (metrics.json) under {str(root)!r}; run `sparsekv eval` first.")
    return results


def _kept(m: dict) -> str:
    return f"b{m['budget']}" if m.get("budget") is not None else f"{m['ratio']:g}"


def _rows(results: list[dict]) -> tuple[list[dict], list[str]]:
    """Table rows (one per model, length, mode, press, kept) with a score per task and their mean."""
    tasks = sorted({m["task"] for m in results})
    rows: dict[tuple, dict] = {}
    for m in results:
        mode = "-" if m["press"] == "full" else m["mode"]  # the full cache does not depend on the mode
        amount = (1, -m["budget"]) if m.get("budget") is not None else (0, -m["ratio"])  # most kept first
        key = (m["model"], m["length"], m["press"] != "full", m["press"], mode != "question", amount)
        row = rows.setdefault(key, {"model": m["model"], "length": m["length"], "mode": mode, "press": m["press"],
                                    "kept": _kept(m), "kv": [], "errors": 0, "samples": 0,
                                    **{t: None for t in tasks}})
        row[m["task"]] = m["score"]
        row["kv"].append(m["kv_fraction"])
        row["errors"] += m.get("errors", 0)
        row["samples"] += m.get("samples", 0)
    ordered = [rows[k] for k in sorted(rows)]
    for row in ordered:
        scores = [row[t] for t in tasks]
        row["mean"] = None if None in scores else sum(scores) / len(scores)
        row["kv"] = sum(row["kv"]) / len(row["kv"])
    return ordered, tasks


def wilson(score: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval (in %) of an accuracy `score` (in %) measured on `n` samples."""
    if n <= 0:
        return 0.0, 100.0
    p = score / 100
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * max(0.0, centre - half), 100 * min(1.0, centre + half)


def format_report(results: list[dict]) -> str:
    """The results as a plain-text table (scores in %)."""
    rows, tasks = _rows(results)
    columns = [("model", "model", ""), ("length", "length", "d"), ("mode", "mode", ""), ("press", "press", ""),
               ("kept", "kept", ""), ("KV kept", "kv", ".2f")]
    columns += [(t, t, ".1f") for t in tasks] + [("mean", "mean", ".1f"), ("errors", "errors", "d")]
    return format_table(rows, columns)


def plot(results: list[dict], path: str | Path) -> Path:
    """Write the score-vs-KV-kept plot to `path` (PNG) and return it."""
    fig = figure(results)
    fig.savefig(path, dpi=120)
    return Path(path)


def figure(results: list[dict]):
    """The score-vs-KV-kept plot as a matplotlib `Figure`: a panel per model and length."""
    require("matplotlib", "plot", "to draw plots")
    from matplotlib.figure import Figure

    rows, tasks = _rows(results)
    panels = defaultdict(list)
    for row in rows:
        if row["mean"] is not None:  # a row missing a task has no mean to plot
            panels[(row["model"], row["length"])].append(row)
    fig = Figure(figsize=(6.5 * len(panels), 4.8))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, ((model, length), panel) in zip(axes[0], sorted(panels.items())):
        lines, low, high = defaultdict(list), [], []
        for row in panel:
            lo, hi = wilson(row["mean"], row["samples"])
            low.append(lo), high.append(hi)
            if row["press"] == "full":
                ax.axhline(row["mean"], color="black", linestyle=":", label="full cache")
                ax.axhspan(lo, hi, color="black", alpha=0.08)
            else:
                lines[(row["press"], row["mode"])].append((row["kv"], row["mean"], lo, hi))
        colors = {press: f"C{i}" for i, press in enumerate(sorted({press for press, _ in lines}))}
        kv = [x for points in lines.values() for x, *_ in points] or [1.0]
        span = max(max(kv) - min(kv), 0.02)
        for i, (press, mode) in enumerate(sorted(lines, key=lambda key: (key[0], key[1] != "question"))):
            xs, ys, los, his = zip(*sorted(lines[press, mode]))
            dodge = (i - (len(lines) - 1) / 2) * 0.006 * span  # lines side by side, so their bars do not overlap
            xs = [x + dodge for x in xs]
            label = press if mode == "question" else f"{press} ({mode})"
            ax.errorbar(xs, ys, yerr=[[y - lo for y, lo in zip(ys, los)], [hi - y for y, hi in zip(ys, his)]],
                        marker="o", capsize=3, color=colors[press], linestyle="-" if mode == "question" else "--",
                        label=label)
        n = max(row["samples"] for row in panel) // len(tasks)
        title = (f"{model}, {length} tokens: mean over {len(tasks)} task{'s' * (len(tasks) > 1)}, {n} samples each "
                 f"({', '.join(tasks)}); bars: 95% Wilson interval")
        ax.set(title=textwrap.fill(title, 80),
               xlabel="fraction of the KV cache kept", ylabel="mean score (%)",
               xlim=(max(0.0, min(kv) - 0.1 * span), max(kv) + 0.1 * span),
               ylim=(max(0.0, min(low) - 3), min(100.0, max(high) + 3)))
        ax.title.set_fontsize("small")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
