"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .floored import FlooredScorerPress


@dataclass(kw_only=True)
class TOVAPress(FlooredScorerPress):
    """Keep the tokens the newest query attends most, averaged over all of a layer's heads, so every head keeps
    the same tokens (the paper's policy). The prompt is ranked by its last token's attention, which keeps that
    token (kvpress's reading); each decoding step then evicts, per row, the token the step's query attends least
    once the row holds more than its budget, so the cache holds the budget from the prompt to the last token.

    Args:
        ratio: fraction of each prompt's KV kept, in (0, 1], held while decoding. 1.0 evicts nothing.
        budget: tokens kept per sequence, at least `min_budget`: a shorter prompt is kept whole and its row
            grows to the budget while decoding before it evicts.
        min_budget: the fewest tokens a row holds (default 64, sparsekv's; `FlooredScorerPress`): a chat turn and
            its answer within it decode untouched.
    """

    reads_step_attention: ClassVar[bool] = True  # `score_step` reads the step's attention

    def prompt_tail(self) -> int:
        return 1  # the last prompt token's query

    def score(self, ctx) -> torch.Tensor:
        scores = self.score_step(ctx)  # the prompt's last query, (batch, kv_heads, prompt)
        return scores.masked_fill(torch.arange(scores.shape[-1], device=scores.device) == scores.shape[-1] - 1,
                                  float("inf"))

    def score_step(self, ctx) -> torch.Tensor:
        # The forward's last query (a draft's: its last token), averaged over every head of the layer.
        probs = ctx.attention(-1).mean(dim=(1, 2, 3))
        return probs[:, None].expand(-1, ctx.keys.shape[1], -1)
