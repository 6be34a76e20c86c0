"""The benchmark's rows (`summarize`), its table and its plots."""

from __future__ import annotations

from pathlib import Path

from ..models import require
from ..table import format_table
from .settings import Setting
from .timing import medians, running_median


def ratio(a, b) -> float | None:
    """`a / b`, None when either is missing (a metric a run did not measure)."""
    return a / b if a is not None and b else None


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
            row[f"{name}_vs_full"] = ratio(m[metric], med[full][metric]) if full else None
            row[f"{name}_vs_oracle"] = ratio(m[metric], med[oracle][metric]) if oracle else None
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
    batches = sorted({row["batch"] for row in rows})
    ax.set_xticks(batches, labels=[str(b) for b in batches])
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


# --- the benchmark -----------------------------------------------------------------------------------------------


def format_capacity(rows: list[dict], memory_budget_gb: float) -> str:
    for row in rows:
        row["largest batch"] = f"{row['batch']}{'+' if row['capped'] else ''}"
    columns = [("config", "config", ""), ("length", "length", "d"), ("KV kept tok", "kept", "d"),
               (f"largest batch in {memory_budget_gb:g} GB", "largest batch", ""),
               ("its memory MB", "memory_mb", ".0f"), ("its tok/s", "tok_s", ".1f")]
    return format_table(rows, columns)
