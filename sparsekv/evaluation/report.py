"""`sparsekv report`: the results of `sparsekv eval` as a table and a plot.

The table has one row per model, length, mode, press and amount kept, one column per task (scores in %),
their mean, and the number of samples the press could not run (counted wrong). The plot shows, per model and
length, the mean score against the fraction of the KV cache kept: one line per press (dashed for
question-agnostic runs), the full cache as a horizontal reference line.
"""

from __future__ import annotations

import json
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
                                    "kept": _kept(m), "kv": [], "errors": 0, **{t: None for t in tasks}})
        row[m["task"]] = m["score"]
        row["kv"].append(m["kv_fraction"])
        row["errors"] += m.get("errors", 0)
    ordered = [rows[k] for k in sorted(rows)]
    for row in ordered:
        scores = [row[t] for t in tasks if row[t] is not None]
        row["mean"] = sum(scores) / len(scores)
        row["kv"] = sum(row["kv"]) / len(row["kv"])
    return ordered, tasks


def format_report(results: list[dict]) -> str:
    """The results as a plain-text table (scores in %)."""
    rows, tasks = _rows(results)
    columns = [("model", "model", ""), ("length", "length", "d"), ("mode", "mode", ""), ("press", "press", ""),
               ("kept", "kept", ""), ("KV kept", "kv", ".2f")]
    columns += [(t, t, ".1f") for t in tasks] + [("mean", "mean", ".1f"), ("errors", "errors", "d")]
    return format_table(rows, columns)


def plot(results: list[dict], path: str | Path) -> Path:
    """Write the score-vs-KV-kept plot to `path` (PNG) and return it."""
    require("matplotlib", "plot", "to draw plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, _ = _rows(results)
    panels = defaultdict(list)
    for row in rows:
        panels[(row["model"], row["length"])].append(row)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, ((model, length), panel) in zip(axes[0], sorted(panels.items())):
        lines = defaultdict(list)
        for row in panel:
            if row["press"] == "full":
                ax.axhline(row["mean"], color="black", linestyle=":", label="full cache")
            else:
                lines[(row["press"], row["mode"])].append((row["kv"], row["mean"]))
        colors = {press: f"C{i}" for i, press in enumerate(sorted({press for press, _ in lines}))}
        for press, mode in sorted(lines, key=lambda key: (key[0], key[1] != "question")):
            xs, ys = zip(*sorted(lines[press, mode]))
            label = press if mode == "question" else f"{press} ({mode})"
            ax.plot(xs, ys, marker="o", color=colors[press], linestyle="-" if mode == "question" else "--",
                    label=label)
        ax.set(title=f"{model}, {length} tokens", xlabel="fraction of the KV cache kept", ylabel="score (%)",
               xlim=(0, 1.02), ylim=(-2, 102))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
