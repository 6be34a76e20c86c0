"""Checking a press's options: numbers in their ranges, and the slips a user makes first (a positional ratio,
kvpress's spellings, a misspelt name), each refused with what to write instead."""

from __future__ import annotations

import dataclasses
import difflib
import numbers

import torch


def check_number(owner: str, name: str, value, *, integer: bool = False, low=None, high=None,
                 low_open: bool = False, unit: str = ""):
    """`value` as a Python int or float (numpy scalars accepted, booleans refused), or a ValueError naming
    `owner.name` and the allowed range: `[low, high]`, `(low, high]` when `low_open`."""
    kind = numbers.Integral if integer else numbers.Real
    ok = isinstance(value, kind) and not isinstance(value, (bool, torch.Tensor))
    if ok:
        value = int(value) if integer else float(value)
        ok = (low is None or (value > low if low_open else value >= low)) and (high is None or value <= high)
    if not ok:
        if high is None:
            bound = f"{'>' if low_open else '>='} {low}"
        else:
            bound = f"in {'(' if low_open else '['}{low}, {high}]" if low is not None else f"<= {high}"
        what = "an integer " if integer else "" if high is not None else "a number "
        raise ValueError(f"{owner}: {name} must be {what}{bound}{f' ({unit})' if unit else ''}; got {value!r}.")
    return value


# kvpress's spellings of sparsekv's options (what a user coming from kvpress writes first).
KVPRESS_NAMES = {"n_sink": "n_sinks", "chunk_length": "chunk_size", "window": "window_size", "kernel": "kernel_size"}
# Options sparsekv renamed, old name -> (new name, why), for the presses that take the new one (what code written
# for an earlier version passes). A sweep's budget (`make_press`'s defaults) sets CHESS's read_budget.
RENAMED = {"plan": ("rank_at", ""),
           "budget": ("read_budget", " (CHESS keeps every token: its budget is the tokens a step reads, and budget= "
                                     "means tokens kept)")}


def check_arguments(cls, args: tuple, kwargs: dict) -> None:
    """A TypeError naming the slip and the sparsekv spelling, for arguments the press class `cls` does not take:
    a positional ratio, an unknown option (kvpress's `compression_ratio`, `n_sink`, ...)."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    positional = [f.name for f in fields if not f.kw_only]
    name = cls.__name__
    if len(args) > len(positional):
        extra = args[len(positional)]
        given = [*positional, f"ratio={extra!r}" if isinstance(extra, numbers.Real) else "ratio=..."]
        raise TypeError(f"{name} takes its options by keyword: {name}({', '.join(given)}), not {name}(" +
                        ", ".join(map(repr, args)) + ").")
    names = {f.name for f in fields}
    for key, value in kwargs.items():
        if key in names:
            continue
        if key == "compression_ratio":
            kept = f" (here ratio={1 - value:g})" if isinstance(value, numbers.Real) else ""
            hint = ("kvpress's compression_ratio is the fraction of the KV cache removed; sparsekv's ratio is the "
                    f"fraction kept: ratio = 1 - compression_ratio{kept}.")
        elif key in KVPRESS_NAMES and KVPRESS_NAMES[key] in names:
            hint = f"sparsekv spells it {KVPRESS_NAMES[key]}."
        elif key in RENAMED and RENAMED[key][0] in names:
            hint = f"it is called {RENAMED[key][0]} now{RENAMED[key][1]}: {RENAMED[key][0]}={value!r}."
        else:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {close[0]}?" if close else "it is not one of its options."
        raise TypeError(f"{name}: unknown option {key}={value!r}: {hint} Its options: {', '.join(sorted(names))}.")
