"""The one registry of presses: a name for each press class, built in or from another package.

A press is built from a spec string, `name` or `name:key=value,key=value` (`:` also separates options):
`make_press("chunkkv:ratio=0.1,reuse_layers=1")`. Names are case-insensitive and a press's class name works
too (`ChunkPress`, `ChunkKVPress`). Option values are Python literals, checked against the dataclass field's
type (`ratios=(0.5,0.2,0.1)`, `reselect=always`, `pre_rope=false`).

Other packages add presses through the entry-point group `sparsekv.presses`, `name = "package.module:Class"`;
they then work everywhere a press is named (`sparsekv eval --presses name`, `sparsekv bench`).
"""

from __future__ import annotations

import ast
import dataclasses
import types
import typing
from importlib.metadata import entry_points
from typing import Any

from ..log import logger
from ..options import RENAMED
from ..press import Press
from .adakv import AdaKVPress
from .chess import CHESSPress
from .chunkkv import ChunkPress
from .decoding import DecodingPress
from .expected_attention import ExpectedAttentionPress
from .h2o import H2OPress
from .keydiff import KeyDiffPress
from .kvzip import KVzipPress
from .knorm import KnormPress
from .pyramidkv import PyramidKVPress
from .sentencekv import SentencePress
from .snapkv import SnapKVPress
from .streaming_llm import StreamingLLMPress
from .tova import TOVAPress

ENTRY_POINT_GROUP = "sparsekv.presses"
BUILT_IN: dict[str, type[Press]] = {
    "snapkv": SnapKVPress,
    "h2o": H2OPress,
    "streamingllm": StreamingLLMPress,
    "chunkkv": ChunkPress,
    "sentencekv": SentencePress,
    "chess": CHESSPress,
    "knorm": KnormPress,
    "keydiff": KeyDiffPress,
    "tova": TOVAPress,
    "pyramidkv": PyramidKVPress,
    "expectedattention": ExpectedAttentionPress,
    "adakv": AdaKVPress,
    "kvzip": KVzipPress,
    "decoding": DecodingPress,
}


def registered() -> dict[str, type[Press]]:
    """Every press by name: the built-in ones, then those of installed packages (read anew at each call, so a
    package installed while Python runs is seen)."""
    presses = dict(BUILT_IN)
    for point in entry_points(group=ENTRY_POINT_GROUP):
        name = point.name.lower()
        if name in presses:
            logger.warning("sparsekv: the press %r of %s is ignored: the name is taken.", name, point.value)
            continue
        try:
            cls = point.load()
        except Exception as err:  # a broken plug-in must not break the built-in presses
            logger.warning("sparsekv: the press %r (%s) could not be loaded: %s", name, point.value, err)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Press)):
            logger.warning("sparsekv: the press %r (%s) is not a Press subclass; ignored.", name, point.value)
            continue
        presses[name] = cls
    return presses


def press_class(name: str) -> type[Press]:
    """The press class called `name` (a registered name or a class name, any case)."""
    presses = registered()
    wanted = name.strip().lower()
    if wanted in presses:
        return presses[wanted]
    for cls in presses.values():
        if wanted in (cls.__name__.lower(), cls.__name__.lower().removesuffix("press")):
            return cls
    aliases = {"chunkkvpress": ChunkPress, "sentencekvpress": SentencePress}
    if wanted in aliases:
        return aliases[wanted]
    raise ValueError(f"unknown press {name!r}; known presses: {', '.join(presses)}.")


def needs_tokenizer(cls: type[Press]) -> bool:
    """Whether the press is built with the model's tokenizer (its first argument)."""
    return any(f.name == "tokenizer" for f in dataclasses.fields(cls))


def split_specs(text: str) -> list[str]:
    """A comma-separated list of press specs, `snapkv,chunkkv:ratio=0.1,reuse_layers=1,h2o`, as a list: a piece
    that is an option (`key=value`) belongs to the spec before it."""
    specs: list[str] = []
    for piece in _split(text, ","):
        piece = piece.strip()
        if not piece:
            continue
        key = piece.partition("=")[0]
        if specs and "=" in piece and ":" not in key and ":" in specs[-1]:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def parse_spec(spec: str) -> tuple[type[Press], dict]:
    """`"name:key=value,..."` -> `(class, {key: value})`, each value checked against its field's type."""
    if not isinstance(spec, str):
        raise TypeError(f"spec: a press spec is a string, `name` or `name:key=value,...` such as "
                        f"'snapkv:ratio=0.1'; got {type(spec).__name__} {spec!r}.")
    name, _, rest = spec.strip().partition(":")
    cls = press_class(name)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    options = {}
    for option in (o.strip() for o in _split(rest, ",:")):
        if not option:
            continue
        key, sep, value = (part.strip() for part in option.partition("="))
        if not sep or not key:
            raise ValueError(f"{spec!r}: options are key=value after the name, e.g. chunkkv:ratio=0.1,reuse_layers=1; "
                             f"got {option!r}.")
        if key not in fields or key == "tokenizer":
            known = ", ".join(k for k in fields if k != "tokenizer")
            new, why = RENAMED.get(key, (None, ""))
            hint = f"it is called {new} now{why}: {name}:{new}={value}; " if new in fields else ""
            raise ValueError(f"{spec!r}: {cls.__name__} has no option {key!r}; {hint}its options: {known}.")
        options[key] = _typed(cls, key, value, hints.get(key, typing.Any))
    return cls, options


def check_spec(spec: str, **options) -> None:
    """Raise ValueError for a spec that names no press or gives a bad option; build it when that needs no
    tokenizer (values are checked then too)."""
    cls, parsed = parse_spec(spec)
    if not needs_tokenizer(cls):
        _build(cls, spec, parsed, options, None)


def make_press(spec: str, tokenizer: Any = None, **options) -> Press:
    """The press `spec` (`name` or `name:key=value,...`); `options` are defaults the spec's own override (e.g.
    the ratio of a sweep). A press that reads text (SentenceKV) needs the model's `tokenizer`."""
    cls, parsed = parse_spec(spec)
    if needs_tokenizer(cls) and tokenizer is None:
        raise ValueError(f"{cls.__name__} needs the model's tokenizer: make_press({spec!r}, tokenizer=tokenizer).")
    return _build(cls, spec, parsed, options, tokenizer)


def wrapped_press(owner: str, press: Press | str, ratio: float | None, budget: int | None) -> Press | Any:
    """A wrapper's press (AdaKV's, DecodingPress's): `press` given the wrapper's `ratio` / `budget` when either is
    set (as `dataclasses.replace` would), or a registered press's name made with them (a spec's
    `adakv:press=knorm,ratio=0.1`). Anything else as it is, for the wrapper to refuse by name."""
    if isinstance(press, str):
        try:
            return make_press(press, ratio=ratio, budget=budget)
        except ValueError as err:
            raise ValueError(f"{owner}: press={press!r}: {err}") from None
    if isinstance(press, Press) and (ratio is not None or budget is not None):
        return dataclasses.replace(press, ratio=ratio, budget=budget)
    return press


def resolved_options(spec: str, **options) -> str:
    """Every option the press `spec` is built with in this version, its defaults included (the tokenizer apart),
    as text: `options` as in `make_press`. A press that reads text is not built (it needs the tokenizer), nor one
    these options cannot build (its run records the error): its declared defaults stand for it, the spec's
    options over them."""
    cls, parsed = parse_spec(spec)
    values = {f.name: f.default for f in dataclasses.fields(cls) if f.init and f.default is not dataclasses.MISSING}
    values.update(_options(cls, parsed, options))
    if not needs_tokenizer(cls):
        try:
            press = _build(cls, spec, parsed, options, None)
            values = {f.name: getattr(press, f.name) for f in dataclasses.fields(press) if f.init}
        except ValueError:
            pass
    return ", ".join(f"{k}={v!r}" for k, v in values.items() if k != "tokenizer")


def _options(cls, parsed: dict, defaults: dict) -> dict:
    """The options a press is built with: the spec's own over `defaults` (a sweep's ratio), whose ratio and budget
    give way when the spec sets its budget (its ratio, budget, or e.g. CHESS's preset); the spec's own are all
    kept, so that one that gives two is refused as the class refuses it."""
    if any(key in parsed for key in ("ratio", "budget", *cls.budget_options)):
        defaults = {k: v for k, v in defaults.items() if k not in ("ratio", "budget")}
    takes = {f.name for f in dataclasses.fields(cls) if f.init}
    # A sweep's option under the name this press takes it by (a sweep's budget is CHESS's read_budget).
    defaults = {RENAMED[k][0] if k in RENAMED and k not in takes and RENAMED[k][0] in takes else k: v
                for k, v in defaults.items()}
    options = {**defaults, **parsed}
    return {k: v for k, v in options.items() if v is not None or k not in ("ratio", "budget", "read_budget")}


def _build(cls, spec: str, parsed: dict, defaults: dict, tokenizer) -> Press:
    args = (tokenizer,) if needs_tokenizer(cls) else ()
    try:
        return cls(*args, **_options(cls, parsed, defaults))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{spec!r}: {err}") from None


def _split(text: str, separators: str) -> list[str]:
    """`text` split at `separators` outside brackets and quotes."""
    parts, depth, quote, current = [], 0, None, []
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char in separators and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts


def _typed(cls, key: str, text: str, hint):
    """The option's value from its text, as the field's type wants it; ValueError naming the option if not."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    allowed = _types(hint)
    if value is None and type(None) in allowed:
        return None
    if bool in allowed and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if bool in allowed and isinstance(value, bool):
        return value
    if float in allowed and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if int not in allowed or isinstance(value, float) else value
    if int in allowed and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tuple in allowed and isinstance(value, (tuple, list)):
        return tuple(value)
    if str in allowed or typing.Any in allowed:
        return text if not isinstance(value, str) and str in allowed else value
    names = " or ".join(sorted(t.__name__ for t in allowed if t is not type(None)))
    raise ValueError(f"{cls.__name__}: option {key} must be {names}; got {text!r}.")


def _types(hint) -> set:
    if hint is typing.Any:
        return {typing.Any}
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_types(arg) for arg in typing.get_args(hint)))
    return {origin or hint}
