"""The presses `sparsekv eval` and `sparsekv bench` know, by name. Later presses register here:
`PRESSES["name"] = PressClass`.

"full" (None) is the uncompressed cache, the reference every sweep includes. A press may be given with options
after its name, `name:key=value[:key=value...]`, e.g. `chunkkv:reuse_layers=1` (values are Python literals).
Options that set a press's budget themselves (its `budget_options`, e.g. `chess:preset=aggressive`) replace the
sweep's ratio, which then only labels the run.
"""

from __future__ import annotations

import ast
import dataclasses

from .. import CHESSPress, ChunkPress, H2OPress, SentencePress, SnapKVPress, StreamingLLMPress
from ..press import Press

PRESSES: dict[str, type[Press] | None] = {
    "full": None,
    "snapkv": SnapKVPress,
    "h2o": H2OPress,
    "streamingllm": StreamingLLMPress,
    "chunkkv": ChunkPress,
    "sentencekv": SentencePress,
    "chess": CHESSPress,
}


def parse_press(spec: str) -> tuple[str, dict]:
    """`"name:key=value:..."` -> `(name, {key: value})`; raises ValueError for unknown names or bad options."""
    name, *options = spec.split(":")
    if name not in PRESSES:
        raise ValueError(f"--presses: unknown press {name!r}; known presses: {', '.join(PRESSES)}.")
    kwargs = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key:
            raise ValueError(f"--presses: options are key=value after the name, e.g. chunkkv:reuse_layers=1; "
                             f"got {option!r} in {spec!r}.")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    if kwargs and PRESSES[name] is None:
        raise ValueError(f"--presses: the full cache takes no options; got {spec!r}.")
    return name, kwargs


def make_press(spec: str, ratio: float | None = None, budget: int | None = None, tokenizer=None) -> Press | None:
    """The press `spec` (a name, with options) keeping `ratio` of the KV (or `budget` tokens); None for "full".

    `tokenizer` goes to presses that take one (SentenceKV reads sentences from the prompt's text).
    """
    name, kwargs = parse_press(spec)
    cls = PRESSES[name]
    if cls is None:
        return None
    if "tokenizer" in {f.name for f in dataclasses.fields(cls)}:
        kwargs["tokenizer"] = tokenizer
    if any(key in kwargs for key in cls.budget_options):  # e.g. chess:preset=aggressive: the sweep's ratio is a label
        ratio = budget = None
    try:
        return cls(ratio=ratio, budget=budget, **kwargs)
    except TypeError as err:
        raise ValueError(f"--presses: {spec!r}: {err}") from None
