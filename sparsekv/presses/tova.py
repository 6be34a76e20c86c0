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

    captures_step_queries: ClassVar[bool] = True  # `after_step` reads the step's query

    def holds_budget_while_decoding(self) -> bool:
        return self.ratio != 1.0  # (1.0 keeps everything, decoding included)

    def prompt_tail(self) -> int:
        return 1  # the last prompt token's query

    def score(self, cache, layer, call) -> torch.Tensor:
        n = layer.keys.shape[-2]
        probs = call.prefill_probs(layer.keys, n - 1, n)  # (batch, kv_heads, group, 1, prompt)
        scores = probs.mean(dim=(1, 2, 3))[:, None].expand(-1, layer.keys.shape[1], -1)
        return scores.masked_fill(torch.arange(n, device=scores.device) == n - 1, float("inf"))

    def after_step(self, cache, layer, call) -> None:
        if self.holds_budget_while_decoding():
            q_len = cache.forward.q_len  # the forward's last query sees every slot held (a draft: its last token)
            visible = None if q_len == 1 and layer.all_valid else layer.valid[:, :, None, :]
            probs = call.probs(layer.keys, visible, q_len - 1, q_len).mean(dim=(1, 2, 3))
            self.hold_budget(cache, layer, probs[:, None].expand(-1, layer.keys.shape[1], -1))
