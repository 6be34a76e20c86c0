"""AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient
LLM Inference", arXiv 2407.11550)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..context import Context
from ..options import check_number
from ..press import ScorerPress

# What a wrapped press declares to the driver, which the wrapper declares as its own (`AdaKVPress.__post_init__`).
PASSED_ON = ("reads_input_ids", "captures_step_queries", "reads_step_attention", "scores_steps",
             "reads_prompt_in_pieces", "joins_rows", "compiled_decoding")


@dataclass
class AdaKVPress(ScorerPress):
    """Spread each layer's budget over its KV heads by the wrapped press's scores (AdaKV, Algorithm 1).

    A layer keeps, per row, `budget x kv_heads` tokens in all: the best-scored of its heads' scores taken together,
    so that a head whose attention is concentrated keeps few tokens and one whose attention is spread keeps many.
    Each head first keeps its `alpha_safeguard` share of the uniform budget, its best tokens whatever the other
    heads score (AdaKV's safeguard; kvpress's reading: the top `int(alpha_safeguard x budget)` of each head). The
    wrapped press's scores must be comparable between heads: attention received (SnapKV, TOVA), as in the paper,
    or any score on one scale (Expected Attention, Knorm, KeyDiff). Tokens the press always keeps (+inf: SnapKV's
    window) are kept on every head. A press that evicts while decoding (TOVA) holds each head at its own budget.

    The core holds each head's own tokens once the prompt is in (lanes, `sparsekv.lanes`; docs/usage.md,
    "Head-wise budgets"), or, under a press that evicts while decoding, a slot table as wide as the widest head.

    Args:
        press: the scoring press whose scores and row budgets are spread: a `ScorerPress` that keeps by `score`
            (SnapKV, PyramidKV, Expected Attention, Knorm, KeyDiff, TOVA, StreamingLLM),
            `AdaKVPress(SnapKVPress(ratio=0.25))`, or a registered press's name, made with the wrapper's ratio or
            budget (default "snapkv", kvpress's AdaKV-SnapKV: `AdaKVPress(ratio=0.25)`). Its options, `compile`
            included, are the wrapper's.
        ratio: the wrapped press's, unless given here, which gives it to it (as `dataclasses.replace(press,
            ratio=...)` does, so that a sweep can set it on the wrapper).
        budget: the same, for the wrapped press's budget.
        compile: the same, for whether generate compiles the decoding steps.
        alpha_safeguard: fraction of the uniform budget each head keeps whatever the others score, in [0, 1]
            (default 0.20, kvpress's; 1.0 keeps the wrapped press's uniform budgets).
    """

    press: ScorerPress | str = "snapkv"
    alpha_safeguard: float = 0.20
    # Head budgets differ between layers: a step's victims are each layer's own.
    scores_by_position: ClassVar[bool] = False

    def __post_init__(self):
        from .registry import wrapped_press  # (the registry lists this press)

        press = wrapped_press("AdaKVPress", self.press, self.ratio, self.budget)
        kept_by_score = isinstance(press, ScorerPress) and type(press).compress is ScorerPress.compress
        if not kept_by_score or isinstance(press, AdaKVPress) or press.selects_before_attention or press.reads_logits:
            raise ValueError("AdaKVPress: press must be a scoring press that keeps by its `score` (SnapKVPress, "
                             "PyramidKVPress, ExpectedAttentionPress, KnormPress, KeyDiffPress, TOVAPress, "
                             f"StreamingLLMPress); got {type(press).__name__}, which keeps by its own rule.")
        if self.compile and not press.compile:
            press = replace(press, compile=True)
        self.press = press
        self.ratio, self.budget, self.compile = press.ratio, press.budget, press.compile
        for flag in PASSED_ON:  # what the driver does for the wrapped press, it does for the wrapper
            setattr(self, flag, getattr(press, flag))
        self.alpha_safeguard = check_number("AdaKVPress", "alpha_safeguard", self.alpha_safeguard, low=0, high=1,
                                            unit="fraction of the uniform budget")
        super().__post_init__()

    def head_budgets(self, ctx: Context, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """Tokens each row keeps on each KV head `(batch, kv_heads)`: how many of the row's `budget x kv_heads`
        best scores `scores` `(batch, kv_heads, prompt)` (padding -inf) are the head's, once each head's best
        `int(alpha_safeguard x budget)` are lifted to +inf (the safeguard)."""
        b, h, n = scores.shape
        budgets = budgets.to(scores.device)
        finite = scores > float("-inf")
        safe = (budgets.double() * self.alpha_safeguard).long()  # int() of kvpress's reading
        rank_in_head = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        lifted = scores.masked_fill((rank_in_head < safe[:, None, None]) & finite, float("inf"))
        rank = lifted.flatten(1).argsort(dim=-1, descending=True, stable=True).argsort(dim=-1).view(b, h, n)
        return ((rank < (budgets * h)[:, None, None]) & finite).sum(-1)

    # The wrapped press's idea: its scores, its budgets and what it does between them.
    def new_layer(self, layer_idx: int):
        return self.press.new_layer(layer_idx)

    def new_state(self, cache):
        return self.press.new_state(cache)

    def begin_forward(self, ctx: Context) -> None:
        self.press.begin_forward(ctx)

    def read_piece(self, ctx: Context) -> None:
        self.press.read_piece(ctx)

    def score(self, ctx: Context) -> torch.Tensor:
        return self.press.score(ctx)

    def after_step(self, ctx: Context) -> None:
        self.press.after_step(ctx)

    def score_step(self, ctx: Context) -> torch.Tensor:
        return self.press.score_step(ctx)

    def crop(self, cache, length: int) -> None:
        self.press.crop(cache, length)

    def holds_budget_while_decoding(self) -> bool:
        return self.press.holds_budget_while_decoding()

    def min_kept(self) -> tuple[int, str]:
        return self.press.min_kept()

    def prompt_tail(self) -> int | None:
        return self.press.prompt_tail()

    def prompt_budgets(self, lengths: torch.Tensor) -> torch.Tensor | None:
        return self.press.prompt_budgets(lengths)

    def row_budgets(self, ctx: Context) -> torch.Tensor | None:
        return self.press.row_budgets(ctx)

    def attended_beside(self) -> int:
        return self.press.attended_beside()

