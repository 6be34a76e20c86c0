"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .floored import FlooredScorerPress


@dataclass(kw_only=True)
class KeyDiffPress(FlooredScorerPress):
    """Keep the prompt tokens whose keys differ most from the others: each key is scored by its negative cosine
    similarity to the anchor, the mean of the row's normalised keys (the paper's score), per KV head, keys as
    cached. Padding does not enter the anchor (sparsekv's: each row's own real keys).

    Args:
        ratio: fraction of each prompt's KV kept, in (0, 1].
        budget: tokens kept per prompt, at least `min_budget`.
        min_budget: the fewest tokens a row keeps (default 64, sparsekv's; `FlooredScorerPress`).
    """

    def prompt_tail(self) -> int:
        return 0  # keys only: a prompt read in pieces is scored as one

    def score(self, ctx) -> torch.Tensor:
        keys = F.normalize(ctx.keys.float(), dim=-1)  # (batch, kv_heads, prompt, head_dim)
        real = ctx.valid[..., None].to(keys.dtype)
        anchor = (keys * real).sum(dim=2, keepdim=True) / real.sum(dim=2, keepdim=True).clamp(min=1)
        return -F.cosine_similarity(keys, anchor, dim=-1)
