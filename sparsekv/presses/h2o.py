"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..context import Context
from ..options import check_number
from ..press import ScorerPress


@dataclass(kw_only=True)
class H2OPress(ScorerPress):
    """Keep heavy hitters (tokens that received the most attention) and the most recent tokens.

    Scores are the attention each token has received, accumulated over every query so far (all prompt
    queries, then every decoding step) and divided by the number of queries that could see it, so early tokens
    are not favoured for being old. The cache is cut to the budget at prefill and one token is evicted at every
    decoding step, so it never holds more than the budget after a step (paper sec. 4, Algorithm 1).

    The prompt's attention is recomputed in blocks of `block_size` queries (never an L x L matrix); a decoding
    step's is the one its attention computed (`reads_step_attention`: over sdpa or eager; with flash attention,
    recomputed from its queries).

    A row never holds fewer than `window_size` tokens (the floor): a ratio's budget is raised to it, so a prompt
    and its answer that fit in it (a chat turn of a few dozen tokens) are never evicted, and the output is the
    model's own. The paper's caches are a fraction of sequences of hundreds of tokens and more; it sets no floor
    (sparsekv's choice, as StreamingLLM's sinks and window).

    Args:
        ratio: fraction of each prompt's KV kept (heavy + recent), in (0, 1], held while decoding; at least
            `window_size` tokens. 1.0 evicts nothing.
        budget: tokens kept per sequence (heavy + recent), at least `window_size`: a shorter prompt is kept whole,
            and its row grows to the budget while decoding before it evicts.
        recent_ratio: share of the budget reserved for the most recent tokens (default 0.5: the paper's even
            heavy / recent split, sec. 5).
        window_size: the most recent tokens always kept, in tokens, and so the fewest a row holds (default 64,
            sparsekv's: a chat turn and its answer decode untouched); the recent window is `recent_ratio` of the
            budget when that is larger.
        block_size: prompt queries scored at once at prefill (memory vs speed; not part of the method).
    """

    recent_ratio: float = 0.5
    window_size: int = 64
    block_size: int = 256
    reads_step_attention: ClassVar[bool] = True  # `after_step` adds up the step's attention
    compiled_decoding: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        self.recent_ratio = check_number("H2OPress", "recent_ratio", self.recent_ratio, low=0, high=1,
                                         unit="share of the budget")
        self.block_size = check_number("H2OPress", "block_size", self.block_size, integer=True, low=1,
                                       unit="queries")
        self.window_size = check_number("H2OPress", "window_size", self.window_size, integer=True, low=1,
                                        unit="recent tokens always kept")
        self.check_floor()

    def min_kept(self) -> tuple[int, str]:
        """The floor: the recent window, kept at every step."""
        return self.window_size, f"window_size={self.window_size}"

    def heavy_scores(self, ctx: Context) -> torch.Tensor:
        """Each slot's score `(batch, heads, slots)`: the attention its token received, over the queries that saw
        it (so that early tokens are not favoured for being old); +inf for the recent window, the last
        `recent_ratio` of each row's budget, always kept.

        The tokens seen are the newest token's position plus one, read from the layer's last slot (where a
        forward's newest token is until an eviction moves it): on the device, so that nothing which changes from
        step to step is read on the host (a compiled step would be traced anew for it)."""
        age = ctx.positions[..., -1:] + 1 - ctx.positions  # queries that saw each token (its own included)
        return (ctx.extra["received"] / age).masked_fill_(age <= self.recent(ctx), float("inf"))

    def recent(self, ctx: Context) -> torch.Tensor:
        """`(batch, 1, 1)` the size of each row's recent window, `recent_ratio` of its budget (rounded), at least
        `window_size`: the same at every layer of a forward, so made at its first (`ctx.plan`) and read by the
        others."""
        plan, budgets = ctx.plan, ctx.budgets
        if plan is None or plan.device != budgets.device:  # (a model split over devices makes it anew on each)
            recent = (budgets.double() * self.recent_ratio).round().long().clamp(min=self.window_size)
            plan = ctx.plan = recent[:, None, None]
        return plan

    def compress(self, ctx: Context) -> None:
        """The attention each prompt token received, kept with its slot (`layer.extra`, which follows the slots),
        then the prompt kept by `heavy_scores` (`ScorerPress`)."""
        if not self.holds_budget_while_decoding():  # everything kept, decoding included: nothing to score
            ctx.extra.pop("received", None)  # (a prompt read in pieces) as in one forward
            return
        # The prompt's received attention does not depend on the budget: replays of one prompt share it. A prompt
        # kept whole needs it too: its budget is held once decoding grows past it.
        received = ctx.prompt_work(("h2o-received", ctx.layer_idx), lambda: self.received(ctx))
        ctx.extra["received"] = received.clone()
        super().compress(ctx)

    def score(self, ctx: Context) -> torch.Tensor:
        return self.heavy_scores(ctx)

    def received(self, ctx: Context) -> torch.Tensor:
        """Attention each prompt token received from all prompt queries, summed per KV head `(b, h_kv, n)`: from
        the forward's queries (its last `q_len` tokens: a prompt, or a piece of one), added to what earlier pieces
        of the prompt gave (`read_piece`)."""
        b, h_kv, n, _ = ctx.keys.shape
        earlier = ctx.extra.get("received")
        received = torch.zeros(b, h_kv, n, dtype=torch.float32, device=ctx.keys.device) if earlier is None \
            else earlier.clone()
        for start in range(n - ctx.q_len, n, self.block_size):
            end = min(start + self.block_size, n)
            received[..., :end] += ctx.attention(start, end).sum(dim=(2, 3))
        return received

    def prompt_tail(self) -> int | None:
        return 0  # every query's attention is read piece by piece (`read_piece`)

    def read_piece(self, ctx: Context) -> None:
        """A piece of a prompt read in pieces: the attention its queries gave every token so far, kept with the
        slots (zeros for the next piece's tokens) until `compress` adds the last piece's."""
        ctx.extra["received"] = self.received(ctx)

    def after_step(self, ctx: Context) -> None:
        """Algorithm 1 at a decoding step: the attention the step's queries give every slot joins what each
        received (summed over each KV head's query heads); `score_step` then ranks them."""
        if self.holds_budget_while_decoding():
            ctx.extra["received"] += ctx.attention().sum(dim=(2, 3))

    def score_step(self, ctx: Context) -> torch.Tensor:
        """A row over its budget evicts its lowest-scored tokens (`heavy_scores`)."""
        return self.heavy_scores(ctx)
