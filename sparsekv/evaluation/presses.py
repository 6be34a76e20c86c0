"""Presses by name for `sparsekv eval` and `sparsekv bench`: the registry's (`sparsekv.presses.registry`),
plus "full", the uncompressed cache every sweep includes as its reference.

A press is given with options after its name, `name:key=value,...`, e.g. `chunkkv:reuse_layers=1`. Options that
set a press's budget themselves (its `budget_options`, e.g. `chess:preset=aggressive`) replace the sweep's ratio,
which then only labels the run.
"""

from __future__ import annotations

from ..press import Press
from ..presses import registry

FULL = "full"


def is_full(spec: str) -> bool:
    return spec.strip().lower() == FULL


def known_presses() -> str:
    return ", ".join([FULL, *registry.registered()])


def check_press(spec: str, ratio: float | None = None, budget: int | None = None) -> None:
    """Raise ValueError, naming the option, for a spec no run could build (no model or tokenizer needed)."""
    name, _, options = spec.strip().partition(":")
    if is_full(name):
        if options:
            raise ValueError(f"--presses: the full cache takes no options; got {spec!r}.")
        return
    try:
        registry.press_class(name)
    except ValueError:
        raise ValueError(f"--presses: unknown press {name!r}; known presses: {known_presses()}.") from None
    if ratio is None and budget is None:
        ratio = 1.0  # the options are checked with some budget; the sweep gives the real one
    try:
        registry.check_spec(spec, ratio=ratio if budget is None else None, budget=budget)
    except ValueError as err:
        raise ValueError(f"--presses: {err}") from None


def make_press(spec: str, ratio: float | None = None, budget: int | None = None, tokenizer=None) -> Press | None:
    """The press `spec` keeping `ratio` of the KV (or `budget` tokens); None for "full". `tokenizer` is the
    model's, for presses that read text (SentenceKV)."""
    if is_full(spec):
        return None
    return registry.make_press(spec, tokenizer=tokenizer, ratio=ratio if budget is None else None, budget=budget)


def press_options(spec: str, ratio: float | None = None, budget: int | None = None) -> str | None:
    """Every option `spec` resolves to in this version, defaults included; None for the full cache. Part of a
    run's identity: a run stored under other defaults is not taken for one made with these."""
    if is_full(spec):
        return None
    return registry.resolved_options(spec, ratio=ratio if budget is None else None, budget=budget)
