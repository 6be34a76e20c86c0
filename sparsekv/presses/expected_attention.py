"""Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", arXiv 2510.00636; kvpress's `ExpectedAttentionPress`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..attention import rotate
from ..options import check_number
from ..state import RowState
from .floored import FlooredScorerPress


@dataclass
class ExpectedAttentionState(RowState):
    """Per generation: each layer's running statistics of the prompt's queries (`add_queries`), kept while a
    prompt is read in pieces, until `score` reads them."""

    moments: dict[int, tuple] = field(default_factory=dict)


@dataclass(kw_only=True)
class ExpectedAttentionPress(FlooredScorerPress):
    """Keep the prompt tokens that the queries to come are expected to attend most.

    The queries to come are modelled as Gaussian, per query head: the mean and covariance of the prompt's queries
    before RoPE (each row's own real tokens, its first `n_sink` left out: their queries are outliers), turned by
    the mean RoPE rotation of the row's next `n_future_positions` positions. Under that distribution a key's
    attention logit has the expectation `mu . k / sqrt(d) + k^T Sigma k / (2 d)` (the Gaussian's moment-generating
    function); their softmax over the prompt's keys, averaged over each KV head's query heads and multiplied by
    the value's norm (`(score + epsilon) x ||v||`), scores each token. The first `n_sink` tokens of each row are
    always kept. Query-agnostic in spirit: the statistics are the whole prompt's, not its last tokens'.

    Where sparsekv departs from kvpress's code (the paper's authors'): the statistics come from the queries the
    module makes (its norms and biases included; kvpress projects the hidden states' statistics through the
    query weights, which leaves out Qwen2's bias and refuses Qwen3's and Gemma3's query norms), and the mean
    rotation is the exact mean of the next positions' rotations (a geometric series), read from the layer's own
    RoPE table, so any RoPE scaling the model uses is the one applied.

    Args:
        ratio: fraction of each prompt's KV kept, in (0, 1].
        budget: tokens kept per prompt, at least `min_budget`.
        n_future_positions: positions after the prompt whose mean rotation turns the queries' statistics
            (default 512, kvpress's).
        n_sink: first tokens of each row left out of the statistics and always kept (default 4, kvpress's).
        use_covariance: the covariance term of the expected logit (default True; False: the mean alone).
        use_vnorm: multiply each score by its value's L2 norm (default True).
        epsilon: added to each score before the value norm multiplies it (default 0.0).
        min_budget: the fewest tokens a row keeps (default 64, sparsekv's; `FlooredScorerPress`).
    """

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        self.n_future_positions = check_number(name, "n_future_positions", self.n_future_positions, integer=True,
                                               low=1, unit="positions")
        self.n_sink = check_number(name, "n_sink", self.n_sink, integer=True, low=0, unit="tokens")
        self.epsilon = check_number(name, "epsilon", self.epsilon, low=0, unit="added to each score")

    def new_state(self, cache) -> ExpectedAttentionState:
        return ExpectedAttentionState()

    def prompt_tail(self) -> int:
        return 0  # a prompt read in pieces: each piece's queries join the statistics (`read_piece`)

    def read_piece(self, ctx) -> None:
        self.add_queries(ctx)

    def add_queries(self, ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The forward's queries (a prompt, or a piece of one) join the layer's running statistics: per row the
        tokens counted `(batch,)`, and per query head their mean `(batch, heads, d)` and the sum of their centred
        outer products `(batch, heads, d, d)`, float64, a piece's joined to the earlier ones' (Chan et al.'s
        pairwise update: no raw moments, whose difference would lose the variance under a large mean)."""
        n = ctx.keys.shape[2]  # the prompt's tokens so far; the forward's are the last `q_len`
        rope = ctx.rope  # (of a prompt read in pieces: from its start)
        rope = None if rope is None else tuple(t[:, -ctx.q_len:] for t in rope)
        queries = rotate(ctx.queries(n - ctx.q_len, n).float(), rope, inverse=True)  # before RoPE
        token = torch.arange(n - ctx.q_len, n, device=queries.device)
        weight = (ctx.valid[:, 0, n - ctx.q_len:] & (token >= (ctx.prompt_start + self.n_sink)[:, None])).float()
        count = weight.sum(-1)
        mean = torch.einsum("bn,bhnd->bhd", weight, queries) / count.clamp(min=1)[:, None, None]
        spread = None
        if self.use_covariance:
            centred = queries - mean[:, :, None]
            spread = torch.einsum("bn,bhni,bhnj->bhij", weight, centred, centred).double()
        moments = (count.double(), mean.double(), spread)
        earlier = ctx.state.moments.get(ctx.layer_idx)
        if earlier is not None:
            (n1, mean1, spread1), (n2, mean2, spread2) = earlier, moments
            total = (n1 + n2).clamp(min=1)
            delta = mean2 - mean1
            mean = mean1 + delta * (n2 / total)[:, None, None]
            if spread is not None:
                spread = spread1 + spread2 + delta[..., :, None] * delta[..., None, :] * (n1 * n2 / total)[
                    :, None, None, None]
            moments = (n1 + n2, mean, spread)
        ctx.state.moments[ctx.layer_idx] = moments
        return moments

    def score(self, ctx) -> torch.Tensor:
        keys, values = ctx.keys.float(), ctx.values.float()  # (batch, kv_heads, prompt, head_dim), after RoPE
        b, h_kv, n, d = keys.shape
        count, mean, spread = self.add_queries(ctx)
        del ctx.state.moments[ctx.layer_idx]  # (a prompt's statistics, no longer needed)
        cov = None if spread is None else (spread / count.clamp(min=1)[:, None, None, None]).float()
        mean, cov = self.to_future(mean.float(), cov, ctx.rope)
        mean = mean.view(b, h_kv, -1, d)  # (batch, kv_heads, group, head_dim)
        logits = torch.einsum("bkgd,bknd->bkgn", mean, keys) / math.sqrt(d)
        if cov is not None:
            turned = torch.einsum("bknd,bkgde->bkgne", keys, cov.view(b, h_kv, -1, d, d))  # cov k
            logits = logits + (turned * keys[:, :, None]).sum(-1) / (2 * d)
        logits = logits.masked_fill(~ctx.valid[:, :, None], float("-inf"))
        scores = logits.softmax(dim=-1).mean(dim=2)  # (batch, kv_heads, prompt)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values.norm(dim=-1)
        sink = torch.arange(n, device=keys.device) < (ctx.prompt_start + self.n_sink)[:, None]
        return scores.masked_fill(sink[:, None], float("inf"))

    def to_future(self, mean: torch.Tensor, cov: torch.Tensor | None, rope) -> tuple:
        """`mean` `(batch, heads, d)` and `cov` `(batch, heads, d, d)` of queries before RoPE, turned by the mean
        rotation of each row's next `n_future_positions` positions: `R mean` and `R cov R^T`. RoPE turns each
        pair of dims by `p * theta` at position `p`, so with `z = e^(i theta)`, read from the layer's table at
        the prompt's last two positions (any scaling of the table is kept), the mean over positions `t ... t + T
        - 1` of `e^(i p theta)` is `e^(i t theta) (1 - z^T) / (T (1 - z))`."""
        if rope is None:  # a layer without RoPE: the queries to come are the prompt's
            return mean, cov
        cos, sin = (t[:, -2:].float() for t in rope)  # (batch, 2, rot)
        last, before = torch.complex(cos[:, 1], sin[:, 1]), torch.complex(cos[:, 0], sin[:, 0])
        angle, positions = (last / before).angle(), self.n_future_positions  # theta per dim
        z = torch.polar(torch.ones_like(angle), angle)  # e^(i theta), of unit length whatever the table's scale
        series = torch.where(angle.abs() > 1e-6, (1 - z ** positions) / (positions * (1 - z)), 1 + 0j)
        future = last * z * series  # (batch, rot): the mean of e^(i p theta) from the position after the last
        turn = (future.real[:, None], future.imag[:, None])  # as a (cos, sin) of one token
        mean = rotate(mean[:, :, None], turn)[:, :, 0]
        if cov is not None:  # R cov R^T = rotate(rotate(cov)^T), cov symmetric: rotate(cov) = cov R^T
            cov = rotate(rotate(cov, turn).transpose(-1, -2), turn)
        return mean, cov
