"""ChunkKV (Liu et al., NeurIPS 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference", arXiv 2502.00299)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..cache import SparseCache
from ..context import Context
from ..layers import KVLayer
from ..options import check_number
from ..state import RowState
from .snapkv import SnapKVPress


@dataclass
class ChunkState(RowState):
    """Per generation: each compressed layer's group leader, and the leader's selection for its group."""

    leader: dict[int, int]  # layer index -> index of the first layer of its reuse group
    selection: dict[int, torch.Tensor] = field(default_factory=dict)  # leader -> its scores (batch, 1, prompt)


@dataclass(kw_only=True)
class ChunkPress(SnapKVPress):
    """Keep whole chunks of contiguous prompt tokens, ranked by the observation window's attention; reuse a
    layer's chunks in the next layers.

    1. SnapKV's observation-window scores (`SnapKVPress.window_scores`: the last `window_size` prompt queries,
       GQA-group mean, pooled) are summed over the KV heads and over the tokens of each chunk of `chunk_size`
       contiguous tokens, so every head of a layer keeps the same chunks (paper sec. "Chunk-Based Attention
       Score Aggregation").
    2. The best chunks are kept while they fit in the budget minus the window; the window is always kept. Only
       whole chunks are kept, so up to `chunk_size - 1` tokens of the budget may stay unused (the paper keeps
       top-k chunks and does not say how to fill a remainder).
    3. Layer-wise index reuse: the first layer of each group of `reuse_layers` consecutive compressed layers
       selects; the others keep the same token indices and skip scoring.

    Choices where the paper is silent: chunks start at each row's first real token (so padding never shifts
    them) and cover the prompt before the window; the last, partial chunk is scored by its mean scaled to
    `chunk_size` tokens, neither favoured nor penalised by its length; layers are grouped in the order of the
    layers sparsekv compresses (Gemma3's sliding layers are skipped, not counted).

    Args:
        ratio: fraction of each prompt's KV kept, window included, in (0, 1]; at least the window (a prompt no
            longer than it is kept whole).
        budget: tokens kept per prompt, window included (at least `window_size`).
        window_size: SnapKV's observation window, in tokens (default 32, see `SnapKVPress`).
        kernel_size: SnapKV's pooling kernel, in tokens (default 7, the SnapKV configs; not `SnapKVPress`'s 15:
            whole chunks already keep a value's neighbours, and 15 lost a multi-key needle in the measured cells).
        pooling: SnapKV's pooling, "max" or "avg" (default "max", see `SnapKVPress`).
        chunk_size: tokens per chunk (default 10, paper sec. "Key Insight"; robust from 5 to 20).
        reuse_layers: consecutive layers sharing one selection (default 2, the paper's recommendation: ~0.5%
            quality for ~20% less compression time); 1 selects at every layer.
    """

    kernel_size: int = 7
    chunk_size: int = 10
    reuse_layers: int = 2
    paper_name: ClassVar[str] = "ChunkKV"

    def __post_init__(self):
        super().__post_init__()
        self.chunk_size = check_number("ChunkPress", "chunk_size", self.chunk_size, integer=True, low=1, unit="tokens")
        self.reuse_layers = check_number("ChunkPress", "reuse_layers", self.reuse_layers, integer=True, low=1,
                                         unit="layers")

    def new_state(self, cache: SparseCache) -> ChunkState:
        compressed = [i for i, layer in enumerate(cache.layers) if isinstance(layer, KVLayer)]
        leader = {i: compressed[rank - rank % self.reuse_layers] for rank, i in enumerate(compressed)}
        return ChunkState(leader)

    def score(self, ctx: Context) -> torch.Tensor:
        state, i = ctx.state, ctx.layer_idx
        if state.leader[i] == i:
            state.selection[i] = self.select_chunks(self.window_scores(ctx), ctx.valid[:, 0], ctx.prompt_start,
                                                    ctx.budgets)
        return state.selection[state.leader[i]].expand(-1, ctx.keys.shape[1], -1)

    def select_chunks(self, scores: torch.Tensor, valid: torch.Tensor, start: torch.Tensor,
                      budgets: torch.Tensor) -> torch.Tensor:
        """Token scores `(batch, 1, prompt)` finite for exactly the chosen chunks and the window (-inf for the
        rest), so that the core keeps them and no other token: they fit each row's budget.

        `scores` `(batch, kv_heads, prompt)` from `window_scores`; `valid` `(batch, prompt)`; `start` `(batch,)`
        each row's first real token; `budgets` `(batch,)` tokens kept, window included.
        """
        b, _, n = scores.shape
        c, m = self.chunk_size, n - self.window_size  # chunks cover the m tokens before the window
        device = scores.device
        real = valid[:, :m]
        token = scores[..., :m].sum(dim=1).masked_fill(~real, 0.0)
        n_chunks = -(-m // c) + 1  # + 1: chunk boundaries follow the row's start; last bucket: padding
        chunk = (torch.arange(m, device=device) - start.to(device)[:, None]).clamp(min=0) // c
        chunk = chunk.masked_fill(~real, n_chunks)
        sums = token.new_zeros(b, n_chunks + 1).scatter_add_(1, chunk, token)
        sizes = token.new_zeros(b, n_chunks + 1).scatter_add_(1, chunk, real.to(token.dtype))
        chunk_scores = (sums / sizes.clamp(min=1) * c).masked_fill(sizes == 0, float("-inf"))
        chunk_scores[:, n_chunks] = float("-inf")
        order = chunk_scores.sort(dim=1, descending=True, stable=True).indices
        room = (budgets.to(device) - self.window_size)[:, None]
        fits = (sizes.gather(1, order).cumsum(1) <= room) & chunk_scores.gather(1, order).isfinite()
        chosen = torch.zeros_like(fits).scatter_(1, order, fits)
        keep = chosen.gather(1, chunk) & real
        window = valid[:, m:]  # (all real but in a row shorter than the window, kept whole)
        out = torch.full((b, 1, n), float("inf"), device=device)
        out[:, 0, m:] = out[:, 0, m:].masked_fill(~window, float("-inf"))
        out[:, 0, :m] = torch.where(keep, 0.0, float("-inf"))
        return out
