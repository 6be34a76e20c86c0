"""A run's files: `config.json`, per-process prediction shards, `predictions.jsonl` and `metrics.json`.

Predictions are appended one line per sample as they are made, so an interrupted run loses at most the sample
under way; `metrics.json` is written last, and its presence is what marks a run as finished.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .scoring import aggregate


def read_records(directory: Path) -> dict[int, dict]:
    """Samples already answered in `directory` (merged file and shards); unreadable lines are ignored."""
    records = {}
    for path in [directory / "predictions.jsonl", *sorted(directory.glob("predictions.rank*.jsonl"))]:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                    records[record["index"]] = record
                except (json.JSONDecodeError, KeyError, TypeError):
                    pass
    return records


def open_shard(path: Path):
    """This process's predictions file, for appending; a line cut short by an interruption is ended first."""
    out = path.open("a")
    if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        out.write("\n")
    return out


def write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def merge(directory: Path, config: dict) -> dict:
    """Merge the shards of a finished run into `predictions.jsonl` and write `metrics.json`; return the metrics."""
    records = read_records(directory)
    missing = sorted(set(range(config["samples"])) - set(records))
    if missing:
        raise RuntimeError(f"{directory}: samples {missing} have no prediction; run the sweep again to finish it.")
    ordered = [records[i] for i in range(config["samples"])]
    tmp = directory / "predictions.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in ordered))
    os.replace(tmp, directory / "predictions.jsonl")
    metrics = {
        **config,
        "score": aggregate([r["score"] for r in ordered]),
        "errors": sum("error" in r for r in ordered),
        "kv_fraction": sum(r["kv_fraction"] for r in ordered) / len(ordered),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ordered) / len(ordered),
    }
    write_json(directory / "metrics.json", metrics)
    for shard in directory.glob("predictions.rank*.jsonl"):
        shard.unlink()
    return metrics


def check_config(directory: Path, config: dict) -> None:
    """Raise ValueError when `directory` holds an unfinished run made with other settings."""
    path = directory / "config.json"
    if not path.exists():
        return
    old = json.loads(path.read_text())
    changed = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in config.items() if old.get(k) != v]
    if changed:
        raise ValueError(f"{directory} holds an unfinished run with other settings ({'; '.join(changed)}); "
                         "delete it or choose another --out.")
