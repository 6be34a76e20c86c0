"""What the commands share: argument types, the model placement options, and the names their help lists (kept
here, without importing torch, so that `--help` is quick; tests check them against the registry, the tasks and
`sparsekv.models`)."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Callable

# The built-in presses (`sparsekv.presses.registry.BUILT_IN`), the local tasks (`sparsekv.evaluation.TASKS`) and
# the dtypes of `sparsekv.models.placement`, as the help lists them.
PRESS_NAMES = ("snapkv", "h2o", "streamingllm", "chunkkv", "sentencekv", "chess", "knorm", "keydiff", "tova",
               "pyramidkv", "expectedattention", "adakv", "kvzip", "decoding")
TASK_NAMES = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "niah_single",
              "niah_multikey", "passkey", "prose_number", "prose_code", "prose_name", "prose_multikey")
DTYPES = ("auto", "float32", "bfloat16", "float16")
MODEL_NAMES = ("smollm2-135m", "qwen2.5-0.5b")  # the offline models' aliases (`sparsekv.models.MODELS`), GGUF files
PRESSES_HELP = (f"comma-separated, of: full, {', '.join(PRESS_NAMES)}, or an installed plug-in's name; options "
                "after the name: chunkkv:reuse_layers=1, adakv:press=expectedattention")
MODEL_HELP = f"alias ({', '.join(MODEL_NAMES)}), .gguf file, model folder or Hub id (default: %(default)s)"

# An optional module a command needs: (module, the sparsekv extra that installs it, what for).
Need = tuple[str, str, str]
PANDAS: Need = ("pandas", "eval", "to report results")
MATPLOTLIB: Need = ("matplotlib", "plot", "to draw plots")


def model_needs(model: str) -> list[Need]:
    """What loading `model` takes besides the core: the GGUF reader for an offline alias or a .gguf file."""
    if model in MODEL_NAMES or model.endswith(".gguf"):
        return [("gguf", "gguf", "to load GGUF models"), ("accelerate", "gguf", "to load GGUF models")]
    return []


def check_extras(args: argparse.Namespace, needs: list[Need]) -> None:
    """Before a command does any work: exit through `args.parser.error` naming the missing modules and the one
    `pip install` that brings them all."""
    missing = [need for need in needs if importlib.util.find_spec(need[0]) is None]
    if missing:
        extras = ",".join(sorted({extra for _, extra, _ in missing}))
        said = "; ".join(f"{module} {what}" for module, _, what in dict.fromkeys(missing))
        args.parser.error(f"this command needs {said}: pip install 'sparsekv[{extras}]'")


def fraction(zero_allowed: bool) -> Callable[[str], float]:
    """An argparse type: a float in (0, 1], or [0, 1] when `zero_allowed`."""
    interval = "[0, 1]" if zero_allowed else "(0, 1]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (0 <= value <= 1 if zero_allowed else 0 < value <= 1):
            raise argparse.ArgumentTypeError(f"must be in {interval}; got {value}")
        return value

    return parse


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}; got {value}")
        return value

    return parse


def placement_args(parser: argparse.ArgumentParser) -> None:
    """`--device`, `--dtype`, `--device-map` and `--attn-implementation`, the same for demo, eval and bench."""
    add = parser.add_argument
    add("--device", default="auto", help="torch device: auto (CUDA when available, else CPU), cpu, cuda, cuda:1 "
        "(default: %(default)s)")
    add("--dtype", choices=DTYPES, default="auto",
        help="auto: bfloat16 on a GPU, float32 on a CPU (default: %(default)s)")
    add("--device-map", help="accelerate device map for models larger than one device, e.g. auto (replaces --device)")
    add("--attn-implementation", choices=("sdpa", "eager", "flash_attention_2"), default="sdpa",
        help="(default: %(default)s)")


def placement(args: argparse.Namespace):
    """`(device_map, dtype)` from the parsed placement options; bad values exit through `args.parser.error`."""
    from ..models import placement as resolve

    try:
        device, dtype = resolve(args.device, args.dtype)
    except ValueError as err:
        args.parser.error(str(err))
    return (args.device_map or device), dtype


def csv(item_type: Callable[[str], object]) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of `item_type` values."""

    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError("give at least one value")
        return [item_type(item) for item in items]

    return parse


def press_specs(text: str) -> list[str]:
    """An argparse type: comma-separated press specs, each with its options (`chunkkv:ratio=0.1,reuse_layers=1`)."""
    from ..presses.registry import split_specs

    specs = split_specs(text)
    if not specs:
        raise argparse.ArgumentTypeError("give at least one press")
    return specs
