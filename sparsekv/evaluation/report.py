"""`sparsekv report`: the results of `sparsekv eval` as tables, a plot, and machine-readable files.

Every run (`metrics.json`) becomes one record of a pandas frame (`frame`). Tasks are grouped into families that
never share a table or a mean: "ruler" (RULER's configuration), "noise" (quick needles in RULER's noise haystack),
"prose" (needles in real text), a Hub source (`ruler:...`, `longbench:...`), and a family run on a `--haystack
FILE` is named with that file. Per family, the table is a pivot: one row per model, length, mode, press and amount
kept, what the cache held and attended (measured at the end of each answer, as a share of the tokens seen), one
column per task (score in %), their mean with its 95% Wilson interval over the pooled samples, the samples per task
and the samples the press could not run (counted wrong). A missing task is shown as missing, and its row has no
mean: a mean over the tasks a row happens to have would compare rows on different tasks.

The plot shows, per model, length and family, the mean score against the fraction of the KV cache attended
(what an evicting press keeps; CHESS keeps every token and attends its selection) with its interval: one line
per press (dashed for question-agnostic runs), the full cache as a horizontal band.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from ..models import require
from ..table import format_table

FORMATS = ("text", "md", "csv", "json")


def load_results(directory: str | Path) -> list[dict]:
    """The metrics of every finished run under `directory`; raises ValueError when there are none."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"RESULTS_DIR: {str(root)!r} is not a folder.")
    results = [json.loads(path.read_text()) for path in sorted(root.rglob("metrics.json"))]
    if not results:
        raise ValueError(f"RESULTS_DIR: no finished run (metrics.json) under {str(root)!r}; run `sparsekv eval` first.")
    return results


def wilson(score: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval (in %) of an accuracy `score` (in %) measured on `n` samples."""
    if n <= 0:
        return 0.0, 100.0
    p = score / 100
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * max(0.0, centre - half), 100 * min(1.0, centre + half)


def family(metrics: dict) -> str:
    """The task family of a run: its task's ("ruler", "noise", "prose"), a Hub source, and the haystack file if
    any."""
    from .tasks import TASKS

    task = metrics["task"]
    name = TASKS[task].family if task in TASKS else task.split(":")[0] + " (Hub)"
    haystack = metrics.get("haystack")
    return f"{name}, haystack {Path(haystack).name}" if haystack else name


def frame(results: list[dict]):
    """One row per run: model, length, family, task, mode ("-" for the full cache, which has none), press, kept,
    kv (fraction of the tokens seen whose KV the cache held), attended (fraction attended: below kv for a press
    that selects from what it holds, as CHESS), score (%), samples, errors, and the score's 95% Wilson interval
    (low, high)."""
    require("pandas", "eval", "to report results")
    import pandas as pd

    records = []
    for m in results:
        low, high = wilson(m["score"], m.get("samples", 0))
        budget = m.get("budget")
        records.append({
            "model": m["model"], "length": m["length"], "family": family(m), "task": m["task"],
            "mode": "-" if m["press"] == "full" else m["mode"], "press": m["press"],
            "kept": f"b{budget}" if budget is not None else f"{m['ratio']:g}", "kv": m["kv_fraction"],
            "attended": m.get("attended_fraction", m["kv_fraction"]),
            "score": m["score"], "samples": m.get("samples", 0), "errors": m.get("errors", 0),
            "low": low, "high": high,
            # sort keys: the full cache first, question before agnostic, most kept first
            "_order": (m["press"] != "full", m["press"], m["mode"] != "question",
                       (1, -budget) if budget is not None else (0, -m["ratio"])),
        })
    records.sort(key=lambda r: (r["model"], r["length"], r["family"], r["task"], r["_order"]))
    return pd.DataFrame.from_records(records)


def tables(results: list[dict]) -> dict:
    """Per family, the pivot of its runs: index (model, length, mode, press, kept), a column per task, then
    "KV kept", "attended", "mean", "low", "high" (the mean's interval), "samples" (per task) and "errors"."""
    runs = frame(results)
    keys = ["model", "length", "mode", "press", "kept"]
    out = {}
    for name, group in runs.groupby("family", sort=True):
        scores = group.pivot_table(index=keys, columns="task", values="score", aggfunc="first", dropna=False)
        scores = scores.dropna(how="all")
        tasks = list(scores.columns)
        summary = group.groupby(keys).agg(kv=("kv", "mean"), attended=("attended", "mean"), n=("samples", "sum"),
                                          errors=("errors", "sum"),
                                          order=("_order", "first"))
        table = scores.join(summary)
        table["mean"] = scores.mean(axis=1, skipna=False)  # missing when a task is missing
        complete = table["mean"].notna()
        table["samples"] = (table["n"] / table[tasks].notna().sum(axis=1)).round().astype(int)
        intervals = [wilson(mean, n) if ok else (math.nan, math.nan)
                     for mean, n, ok in zip(table["mean"], table["n"], complete)]
        table["low"], table["high"] = [i[0] for i in intervals], [i[1] for i in intervals]
        table = table.rename(columns={"kv": "KV kept"})
        table = table.iloc[sorted(range(len(table)), key=lambda i: (table.index[i][:2], table["order"].iloc[i]))]
        out[name] = table[[*tasks, "KV kept", "attended", "mean", "low", "high", "samples", "errors"]]
    return out


def _records(table) -> list[dict]:
    """A pivot's rows as dicts, missing values as None (shown as "-")."""
    rows = []
    for index, row in table.reset_index().iterrows():
        rows.append({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()})
    for row in rows:
        row["ci"] = None if row["low"] is None else f"[{row['low']:.0f}, {row['high']:.0f}]"
    return rows


def _columns(table) -> list[tuple[str, str, str]]:
    tasks = [c for c in table.columns if c not in ("KV kept", "attended", "mean", "low", "high", "samples", "errors")]
    return ([("model", "model", ""), ("length", "length", "d"), ("mode", "mode", ""), ("press", "press", ""),
             ("kept", "kept", ""), ("KV kept", "KV kept", ".2f"), ("attended", "attended", ".2f")]
            + [(t, t, ".1f") for t in tasks]
            + [("mean", "mean", ".1f"), ("95% CI", "ci", ""), ("n", "samples", "d"), ("errors", "errors", "d")])


def _markdown(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    numeric = {key for _, key, spec in columns if spec}
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |",
             "| " + " | ".join("---:" if key in numeric else "---" for _, key, _ in columns) + " |"]
    for row in rows:
        cells = [format(row[key], spec) if row[key] is not None else "-" for _, key, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_report(results: list[dict], fmt: str = "text") -> str:
    """The results as text ("text", "md": a table per task family; scores in %) or data ("csv", "json": one
    record per run with its family and the 95% Wilson interval of its score)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format: must be one of {', '.join(FORMATS)}; got {fmt!r}.")
    if fmt in ("csv", "json"):
        runs = frame(results).drop(columns="_order")
        return runs.to_csv(index=False) if fmt == "csv" else runs.to_json(orient="records", indent=1)
    parts = []
    for name, table in tables(results).items():
        rows, columns = _records(table), _columns(table)
        heading = f"{name} tasks: score in %, mean over the tasks with its 95% Wilson interval, n samples per task"
        body = format_table(rows, columns) if fmt == "text" else _markdown(rows, columns)
        parts.append(f"### {heading}\n\n{body}" if fmt == "md" else f"{heading}\n{body}")
    return "\n\n".join(parts)


def plot(results: list[dict], path: str | Path) -> Path:
    """Write the score-vs-KV-kept plot to `path` (PNG) and return it."""
    fig = figure(results)
    fig.savefig(path, dpi=120)
    return Path(path)


def figure(results: list[dict]):
    """The score-vs-KV-kept plot as a matplotlib `Figure`: a panel per model, length and task family."""
    require("matplotlib", "plot", "to draw plots")
    from matplotlib.figure import Figure

    panels = []
    for name, table in tables(results).items():
        rows = [row for row in _records(table) if row["mean"] is not None]  # a row missing a task has no mean
        tasks = list(table.columns[: list(table.columns).index("KV kept")])
        for model, length in sorted({(row["model"], row["length"]) for row in rows}):
            mine = [r for r in rows if (r["model"], r["length"]) == (model, length)]
            panels.append((name, model, length, tasks, mine))
    fig = Figure(figsize=(6.5 * len(panels), 4.8))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (name, model, length, tasks, panel) in zip(axes[0], panels):
        lines = {}
        for row in panel:
            if row["press"] == "full":
                ax.axhline(row["mean"], color="black", linestyle=":", label="full cache")
                ax.axhspan(row["low"], row["high"], color="black", alpha=0.08)
            else:
                lines.setdefault((row["press"], row["mode"]), []).append(
                    (row["attended"], row["mean"], row["low"], row["high"]))
        colors = {press: f"C{i}" for i, press in enumerate(sorted({press for press, _ in lines}))}
        kv = [x for points in lines.values() for x, *_ in points] or [1.0]
        span = max(max(kv) - min(kv), 0.02)
        for i, (press, mode) in enumerate(sorted(lines, key=lambda key: (key[0], key[1] != "question"))):
            xs, ys, los, his = zip(*sorted(lines[press, mode]))
            dodge = (i - (len(lines) - 1) / 2) * 0.006 * span  # lines side by side, so their bars do not overlap
            ax.errorbar([x + dodge for x in xs], ys,
                        yerr=[[y - lo for y, lo in zip(ys, los)], [hi - y for y, hi in zip(ys, his)]],
                        marker="o", capsize=3, color=colors[press], linestyle="-" if mode == "question" else "--",
                        label=press if mode == "question" else f"{press} ({mode})")
        n = max(row["samples"] for row in panel)
        title = (f"{model}, {length} tokens, {name} tasks: mean over {len(tasks)} task{'s' * (len(tasks) > 1)}, "
                 f"{n} samples each ({', '.join(tasks)}); bars: 95% Wilson interval")
        ax.set(title=textwrap.fill(title, 80), xlabel="fraction of the KV cache attended (kept, when a press evicts)",
               ylabel="mean score (%)",
               xlim=(max(0.0, min(kv) - 0.1 * span), max(kv) + 0.1 * span),
               ylim=(max(0.0, min(r["low"] for r in panel) - 3), min(100.0, max(r["high"] for r in panel) + 3)))
        ax.title.set_fontsize("small")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
