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
        # Records made before it was measured hold the nominal share only, as kv_fraction.
        "attended_fraction": sum(r.get("attended_fraction", r["kv_fraction"]) for r in ordered) / len(ordered),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ordered) / len(ordered),
    }
    write_json(directory / "metrics.json", metrics)
    for shard in directory.glob("predictions.rank*.jsonl"):
        shard.unlink()
    return metrics


def check_identity(directory: Path, identity: dict) -> None:
    """Raise ValueError, naming every difference, when `directory` holds a run (finished or not) made with other
    settings than `identity`: a stored run is reused only when all of its configuration matches."""
    for name in ("metrics.json", "config.json"):
        path = directory / name
        if path.exists():
            break
    else:
        return
    stored = json.loads(path.read_text()).get("identity")
    if stored is None:
        raise ValueError(f"{directory} holds a run made by an older sparsekv, without its settings recorded; "
                         "delete it or choose another --out.")
    changed = [f"{k}: {stored.get(k)!r} -> {v!r}" for k, v in identity.items() if stored.get(k) != v]
    changed += [f"{k}: {v!r} -> (not set)" for k, v in stored.items() if k not in identity]
    if changed:
        state = "finished" if name == "metrics.json" else "unfinished"
        raise ValueError(f"{directory} holds a {state} run made with other settings ({'; '.join(changed)}); "
                         "delete it or choose another --out.")
