"""What a measurement ran on, recorded beside its results: package versions, the device, threads, the commit and
a digest of sparsekv's source."""

from __future__ import annotations

import hashlib
import platform
import subprocess
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch


def environment(device: torch.device | str | None = None) -> dict:
    """Versions of sparsekv, transformers and torch, Python, the device's name, torch's CPU threads, the git
    commit of the sparsekv checkout when it is one (None otherwise), and a digest of sparsekv's source files
    (`source_digest`: the code that ran, also where a copied checkout's git metadata is stale)."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine() or device.type
    return {
        "sparsekv": _version("sparsekv"),
        "transformers": _version("transformers"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": name,
        "threads": torch.get_num_threads(),
        "git_commit": git_commit(),
        "source_digest": source_digest(),
    }


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The commit of the git checkout sparsekv is imported from, with `+dirty` when it has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "") if commit else None


@lru_cache(maxsize=None)
def source_digest(root: Path | None = None) -> str:
    """The first 12 hex digits of a sha256 over the `.py` files under `root` (default: the sparsekv package), each
    by its relative path and contents, in path order: equal digests, equal code."""
    root = Path(__file__).resolve().parent if root is None else Path(root)
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]
