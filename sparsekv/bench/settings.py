"""What `sparsekv bench` measures: the configurations (`Setting`), their references, and their inputs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from ..evaluation.presses import check_press, known_presses, make_press

@dataclass(frozen=True)
class Setting:
    """One measured configuration: `press` ("full" or a press spec of the registry) on `batch` prompts of `length`
    tokens; `ragged`: their lengths spread evenly from `length` down to half of it (left-padded)."""

    press: str
    length: int
    ratio: float | None = None
    budget: int | None = None
    batch: int = 1
    ragged: bool = False

    @property
    def kept(self) -> int:
        """Prompt tokens the press keeps of the longest row: its budget, or `ratio` of the prompt (rounded as
        `Press.prompt_budgets`)."""
        if self.press == "full":
            return self.length
        return self.budget if self.budget is not None else max(1, round(self.ratio * self.length))

    def row_lengths(self) -> list[int]:
        """Each row's prompt length."""
        if not self.ragged or self.batch == 1:
            return [self.length] * self.batch
        return [round(self.length * (1 - 0.5 * i / (self.batch - 1))) for i in range(self.batch)]

    def oracle(self) -> Setting:
        """The full cache on prompts as long as what the press keeps of each row, at the same batch."""
        return Setting("full", self.kept, batch=self.batch, ragged=self.ragged and self.budget is None)

    def label(self, lengths) -> str:
        if self.press == "full":
            return "full" if self.length in lengths else "oracle"
        return f"{self.press} " + (f"b={self.budget}" if self.budget is not None else f"r={self.ratio:g}")

    def make_press(self, tokenizer=None):
        return None if self.press == "full" else make_press(self.press, self.ratio, self.budget, tokenizer)


def sweep(lengths, presses, ratios=None, budgets=None, batch_sizes=(1,), ragged: bool = False
          ) -> list[tuple[Setting, Setting, Setting]]:
    """`(press, full cache at the same length and batch, oracle)` for every length x batch x press x ratio (or
    budget).

    Raises ValueError for unknown presses, budgets larger than a length and presses that refuse a budget.
    """
    kept = [(None, b) for b in budgets] if budgets else [(r, None) for r in ratios]
    triples = []
    for length, batch in itertools.product(lengths, batch_sizes):
        full = Setting("full", length, batch=batch, ragged=ragged)
        for name, (ratio, budget) in itertools.product([p for p in presses if p != "full"], kept):
            setting = Setting(name, length, ratio, budget, batch, ragged)  # the full cache is always measured
            if budget is not None and budget > min(setting.row_lengths()):
                raise ValueError(f"--budgets: {budget} exceeds the {min(setting.row_lengths())}-token prompt of "
                                 f"a row ({length} tokens{', ragged' if ragged else ''}).")
            try:
                check_press(name, ratio, budget)
            except ValueError as err:
                raise ValueError(f"{setting.label(lengths)}: {err}") from None
            triples.append((setting, full, setting.oracle()))
    if not triples:
        raise ValueError(f"--presses: give at least one press other than full; known presses: {known_presses()}.")
    return triples


def check_inputs(lengths, presses, ratios, budgets, max_new_tokens: int, repeats: int, context: int | None,
                 plot: str | None = None, json_path: str | None = None) -> None:
    """Raise ValueError with a clear message for any input the benchmark cannot run."""
    for name in presses:
        check_press(name)  # unknown names and options raise, listing the presses
    if (ratios is None) == (budgets is None):
        raise ValueError("give exactly one of --ratios and --budgets.")
    if ratios is not None and not (ratios and all(0 < r <= 1 for r in ratios)):
        raise ValueError(f"--ratios: each must be in (0, 1]; got {ratios}.")
    if budgets is not None and not (budgets and all(isinstance(b, int) and b >= 1 for b in budgets)):
        raise ValueError(f"--budgets: each must be an integer >= 1; got {budgets}.")
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths: give positive token counts; got {lengths}.")
    if max_new_tokens < 2:
        raise ValueError(f"--max-new-tokens: at least 2 (one decoding step); got {max_new_tokens}.")
    if repeats < 1:
        raise ValueError(f"--repeats: at least 1; got {repeats}.")
    if context is not None and max(lengths) + max_new_tokens > context:
        raise ValueError(f"--lengths: {max(lengths)} tokens + {max_new_tokens} generated exceeds the model's "
                         f"context ({context} tokens).")
    for option, path in (("--plot", plot), ("--json", json_path)):
        if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
            raise ValueError(f"{option}: the folder of {path} does not exist.")
    if plot is not None and Path(plot).suffix.lower() != ".png":
        raise ValueError(f"--plot: must be a .png file; got {plot}.")


# --- measuring ---------------------------------------------------------------------------------------------------


def check_rows_apart(settings, tokenizer, lengths) -> None:
    """`--rows-apart` needs presses whose caches join (`Press.joins_rows`): refuse the others before any run."""
    refused = sorted({s.label(lengths) for s in settings
                      if s.press != "full" and not s.make_press(tokenizer).joins_rows})
    if refused:
        raise ValueError(f"--rows-apart: {', '.join(refused)} cannot join rows prefilled apart (CHESS's store "
                         "records every token by position); leave them out, or run without --rows-apart.")


# --- capacity: the largest batch within a memory budget -------------------------------------------------------------


def batch_inputs(source: torch.Tensor, row_lengths: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, attention_mask)`: row i is the last `row_lengths[i]` tokens of `source` `(1, L)`, left-padded."""
    width = max(row_lengths)
    ids = torch.full((len(row_lengths), width), pad_id, dtype=source.dtype, device=source.device)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(row_lengths):
        ids[i, width - n:], mask[i, width - n:] = source[0, -n:], 1
    return ids, mask
