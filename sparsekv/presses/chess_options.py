"""CHESSPress's options: Table 1's presets, and the check that settles the defaults `paper` chooses between and
refuses an option out of its range, naming the allowed one."""

from __future__ import annotations

from ..options import check_number

# Table 1: retention ratios (rho_g, rho_c, rho_p) of grids, chunks and pages.
PRESETS = {"conservative": (0.9, 0.9, 0.9), "moderate": (0.8, 0.7, 0.7), "aggressive": (0.5, 0.2, 0.1)}
RESELECT = ("uncertainty", "always", "never")
POOLING = ("mean", "max")


def settle_options(press) -> None:
    """Check `press`'s options (a `CHESSPress`) and fill the defaults that depend on `paper`; raises ValueError
    naming the option and what it allows."""
    name = type(press).__name__
    if not isinstance(press.paper, bool):
        raise ValueError(f"{name}: paper must be True or False; got {press.paper!r}.")
    for key, ours, papers in (("page_size", 16, 32), ("pooling", "max", "mean"), ("centre", True, False)):
        if getattr(press, key) is None:
            setattr(press, key, papers if press.paper else ours)
    given = [k for k in ("preset", "ratios", "ratio", "read_budget") if getattr(press, k) is not None]
    if len(given) != 1:
        raise ValueError(f"{name}: give exactly one of preset ({', '.join(PRESETS)}), ratios=(rho_g, rho_c, "
                         f"rho_p), ratio (fraction of pages selected, 0 < ratio <= 1) or read_budget (tokens a "
                         f"step attends); got {' and '.join(given) if given else 'none'}.")
    if press.preset is not None and press.preset not in PRESETS:
        raise ValueError(f"{name}: preset must be one of {', '.join(PRESETS)}; got {press.preset!r}.")
    if press.ratio is not None:
        press.ratio = check_number(name, "ratio", press.ratio, low=0, high=1, low_open=True,
                                   unit="fraction of pages selected")
    if press.ratios is not None:
        if not (isinstance(press.ratios, (tuple, list)) and len(press.ratios) == 3):
            raise ValueError(f"{name}: ratios must be three fractions (rho_g, rho_c, rho_p), each in (0, 1]; "
                             f"got {press.ratios!r}.")
        press.ratios = tuple(check_number(name, f"ratios[{i}]", r, low=0, high=1, low_open=True)
                             for i, r in enumerate(press.ratios))
    for key, low in (("page_size", 1), ("chunk_pages", 1), ("grid_chunks", 1), ("sink_pages", 0),
                     ("window_pages", 1)):
        setattr(press, key, check_number(name, key, getattr(press, key), integer=True, low=low))
    if press.read_budget is not None:  # at least the pages always attended: sinks, window and the partial page
        least = (press.sink_pages + press.window_pages + 1) * press.page_size
        press.read_budget = check_number(name, "read_budget", press.read_budget, integer=True, low=least,
                                    unit=f"tokens a step attends; (sink_pages + window_pages + 1) * page_size = "
                                         f"{least} are always attended")
    if press.page_stride is None:
        press.page_stride = press.page_size if press.paper or press.page_size % 2 else press.page_size // 2
    press.page_stride = check_number(name, "page_stride", press.page_stride, integer=True, low=1,
                                     high=press.page_size, unit="tokens")
    if press.page_size % press.page_stride:
        raise ValueError(f"{name}: page_stride must divide page_size ({press.page_size}); got {press.page_stride}.")
    for key in ("pre_rope", "centre"):
        if not isinstance(getattr(press, key), bool):
            raise ValueError(f"{name}: {key} must be True or False; got {getattr(press, key)!r}.")
    for key, allowed in (("pooling", POOLING), ("reselect", RESELECT)):
        if getattr(press, key) not in allowed:
            raise ValueError(f"{name}: {key} must be one of {', '.join(allowed)}; got {getattr(press, key)!r}.")
    if press.reselect_every is not None:
        press.reselect_every = check_number(name, "reselect_every", press.reselect_every, integer=True, low=1,
                                            unit="decoding steps")
    for key, unit in (("entropy_threshold", "nats"), ("varentropy_threshold", "nats^2")):
        setattr(press, key, check_number(name, key, getattr(press, key), low=0, unit=unit))
