"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .floored import FlooredScorerPress


@dataclass(kw_only=True)
class KnormPress(FlooredScorerPress):
    """Keep the prompt tokens whose keys have the smallest L2 norm: a low-norm key draws high attention (the
    paper's finding), so the norm ranks tokens without reading any attention. Per KV head, keys as cached.

    Args:
        ratio: fraction of each prompt's KV kept, in (0, 1].
        budget: tokens kept per prompt, at least `min_budget`.
        min_budget: the fewest tokens a row keeps (default 64, sparsekv's; `FlooredScorerPress`).
    """

    def prompt_tail(self) -> int:
        return 0  # keys only: a prompt read in pieces is scored as one

    def score(self, ctx) -> torch.Tensor:
        return -ctx.keys.float().norm(dim=-1)
