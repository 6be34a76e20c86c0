"""Algorithm 1's operations on one level of CHESS's hierarchy (`sparsekv.presses.chess`): the entries of a row
above a quantile of its scores, the best of them, and the pages covering a number of blocks; over fixed shapes,
with nothing read on the host (a compiled step runs them)."""

from __future__ import annotations

import torch
from torch import nn


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean of `x` over `dim` where `mask` (x's shape without the last dimension) is True; 0 where none is."""
    weight = mask.to(x.dtype)[..., None]
    return (x * weight).sum(dim) / weight.sum(dim).clamp(min=1)


def top_fraction(scores: torch.Tensor, active: torch.Tensor, rho: float | torch.Tensor) -> torch.Tensor:
    """Active entries at or above the `1 - rho` quantile of the active scores of their row (Algorithm 1); `rho`
    one fraction, or one per row `(batch,)` (a budget), interpolated as `torch.quantile` does."""
    if not isinstance(rho, torch.Tensor):
        threshold = scores.masked_fill(~active, float("nan")).nanquantile(1 - rho, dim=-1, keepdim=True)
        return active & (scores >= threshold)
    ranked = scores.masked_fill(~active, float("inf")).sort(dim=-1).values  # the active ones first, ascending
    at = ((1 - rho.to(scores.device)) * (active.sum(-1) - 1).clamp(min=0))[:, None]  # (batch, 1), fractional
    low, high = (ranked.gather(-1, i.long().clamp(min=0)) for i in (at.floor(), at.ceil()))
    threshold = low + (at - at.floor()).to(scores.dtype) * (high - low)
    return active & (scores >= threshold)


def best(scores: torch.Tensor, keep: torch.Tensor, most: torch.Tensor | None) -> torch.Tensor:
    """The `most[row]` best-scored entries of each row of `keep` `(batch, n)` (all of them when None or when they
    are fewer)."""
    if most is None:
        return keep
    order = scores.masked_fill(~keep, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    return keep & (order.argsort(dim=-1) < most[:, None])


def top_covering(scores: torch.Tensor, active: torch.Tensor, budget: torch.Tensor, span: int) -> torch.Tensor:
    """Active pages `(batch, pages)`, best first, while the blocks they cover number at most `budget` `(batch,)`
    (page k covers blocks k ... k + span - 1; the best page at least): Algorithm 1's last level when pages overlap."""
    b, n = scores.shape
    order = scores.masked_fill(~active, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=order.device).expand(b, n))
    rank = rank.masked_fill(~active, n)  # never taken
    # A block is attended once the best-ranked page over it is taken: taking the pages ranked below t attends the
    # blocks whose first rank is below t, so t is the budget-th smallest first rank (at least 1: the best page).
    first = nn.functional.pad(rank, (span - 1, 0), value=n).unfold(1, span, 1).amin(-1)  # (b, blocks)
    limit = first.sort(dim=-1).values.gather(-1, budget.clamp(max=n - 1)[:, None]).clamp(min=1)
    return active & (rank < limit)
