"""Recomputing the attention a press needs, for any attention implementation.

sdpa and flash attention never materialise attention weights, and queries are not cached, so presses rebuild
the queries of the tokens they care about from the layer's input and recompute only those rows of attention.
Works on any transformers attention module with `q_proj` (or fused `qkv_proj`), optional `q_norm`, and RoPE
given as `position_embeddings`: Llama, Qwen2, Qwen3, Mistral, Phi3, Gemma3.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .lanes import Lanes


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def query_norm(module) -> torch.nn.Module | None:
    """The module's norm of its queries before RoPE: `q_norm` (Qwen3, OLMo2), or `q_layernorm` (StableLM, LFM2);
    None if it has none."""
    return getattr(module, "q_norm", None) or getattr(module, "q_layernorm", None)


def query_projection(module) -> torch.nn.Module | None:
    """The module's query projection: `q_proj`, or Phi3's fused `qkv_proj` (queries first); None if neither."""
    return getattr(module, "q_proj", None) or getattr(module, "qkv_proj", None)


def query_groups(module) -> int:
    """Query heads per KV head (GQA): the module's `num_key_value_groups`, else from its config."""
    groups = getattr(module, "num_key_value_groups", None)
    if groups is None:
        config = module.config
        groups = config.num_attention_heads // getattr(config, "num_key_value_heads", config.num_attention_heads)
    return groups


def project_queries(module, hidden_states: torch.Tensor, position_embeddings, grouped: bool = False) -> torch.Tensor:
    """Queries `(batch, heads, tokens, head_dim)` of `hidden_states`, normed and rotated as the module does.

    `position_embeddings` are the `(cos, sin)` of exactly these tokens; `grouped` as in `shape_queries`.
    """
    projection = query_projection(module)
    if projection is None:
        raise NotImplementedError(f"{type(module).__name__} has neither q_proj nor qkv_proj")
    return shape_queries(module, projection(hidden_states), position_embeddings, grouped)


def shape_queries(module, projected: torch.Tensor, position_embeddings, grouped: bool = False) -> torch.Tensor:
    """The query projection's output `(batch, tokens, width)` as the module's queries: split into heads,
    normed (`query_norm`, when the module has one) and rotated with the `(cos, sin)` of these tokens.

    `grouped`: summed over the query heads of each KV head's GQA group, `(batch, kv_heads, tokens, head_dim)`.
    RoPE turns every head of a token alike, so a group is summed before it is rotated (one rotation per group).
    """
    b, n, width = projected.shape
    d = module.head_dim
    if width != module.config.num_attention_heads * d:  # a fused qkv output: keep its queries only
        projected = projected[..., : module.config.num_attention_heads * d]
    q = projected
    norm = query_norm(module)
    width = getattr(norm, "weight", None)
    if width is not None and width.shape[-1] != d:  # over the whole projection (OLMo2), before the heads
        q, norm = norm(q), None
    q = q.reshape(b, n, -1, d) if norm is None else norm(q.reshape(b, n, -1, d))  # per head (Qwen3, Gemma3)
    if grouped:
        q = q.reshape(b, n, module.config.num_key_value_heads, -1, d).sum(3)
    return rotate(q.transpose(1, 2), position_embeddings)


def rotate(x: torch.Tensor, position_embeddings, inverse: bool = False) -> torch.Tensor:
    """RoPE on `x` `(batch, heads, tokens, head_dim)` with the `(cos, sin)` of exactly these tokens; `inverse`
    undoes it (keys as they were before RoPE). Partial rotary (Phi3) rotates the first dims only. None: a layer
    without position embeddings (SmolLM3's NoPE layers), `x` as it is."""
    if position_embeddings is None:
        return x
    cos, sin = (t.unsqueeze(1) if t.dtype == x.dtype else t.unsqueeze(1).to(x.dtype) for t in position_embeddings)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:  # full rotary: no pass-through part to join back (fewer ops per decoding step)
        return x * cos + _rotate_half(x) * (-sin if inverse else sin)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * (-sin if inverse else sin), x_pass], dim=-1)


def attention_probs(module, queries: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
                    mask_from: int = 0) -> torch.Tensor:
    """Softmax attention `(batch, kv_heads, group, q, k)` in float32, query heads grouped by their KV head.

    `queries` are already multiplied by the module's scaling (`AttentionCall.queries(scaled=True)`).
    `mask` is boolean (True where attention is allowed) or additive, broadcastable to `(batch, kv_heads, group,
    q, k - mask_from)`, over the keys from `mask_from` on: every query sees the keys before (a block of prompt
    queries without padding masks only its own keys, one pass over the block's logits fewer). None: every query
    sees every key (a decoding step on a cache of real tokens: no mask to build, nothing to check).
    """
    b, h_q, n_q, d = queries.shape
    h_kv = keys.shape[1]
    q = as_float(queries.reshape(b * h_kv, h_q // h_kv * n_q, d))
    # Batch and heads as one batch dimension: a plain batched product (a view of a cache buffer's keys); `bmm`,
    # not `@`, whose broadcasting rules dispatch five more ops (a step's cost on a CPU is its op count).
    logits = torch.bmm(q, as_float(keys).flatten(0, 1).transpose(1, 2)).view(b, h_kv, h_q // h_kv, n_q, -1)
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if mask is None:
        return logits.softmax(dim=-1)
    seen = logits if mask_from == 0 else logits[..., mask_from:]
    if mask.dtype == torch.bool:
        seen.masked_fill_(~mask, float("-inf"))
    else:  # additive: eager's, or a model's own (Doge's learned bias)
        seen.add_(mask)
    probs = logits.softmax(dim=-1)
    # Fully masked rows (padding queries) give NaN: make them zeros (none can be when all see the keys before).
    # Unasked: one op, where asking whether there are any is three and a host read.
    return probs.nan_to_num_(0.0) if mask_from == 0 else probs


def as_float(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32 (no dispatch when it is already: decoding steps count their ops)."""
    return x if x.dtype == torch.float32 else x.float()


FLOOR = -80.0  # the lowest logit `lane_attention` exponentiates, below its head's largest


def lane_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, lanes: Lanes, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """Softmax attention of `query` `(batch, heads, q, head_dim)` over a layer's `lanes` and its slot table
    (`key`, `value` `(batch, kv_heads, slots, head_dim)`, `attention_mask` over them as sdpa's or eager's, or
    None): `(output (batch, q, heads, head_dim), None)`, as transformers' attention functions return it.

    Every query sees every lane token (they are the prompt's, before any query here). In float32; a masked token
    weighs e^-80 of the largest (`FLOOR`), nothing a float32 sum keeps."""
    b, h, q, d = query.shape
    h_kv = key.shape[1]
    gq = h // h_kv * q  # the queries that read a KV head: its group's, each of the q tokens
    scaling = module.scaling if scaling is None else scaling
    qg = as_float(query).reshape(b, h_kv, gq, d) * scaling
    softcap = getattr(module, "attn_logit_softcapping", None)

    def logits(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        x = torch.matmul(queries, as_float(keys).transpose(-1, -2))
        return x if softcap is None else torch.tanh(x / softcap) * softcap

    own = logits(qg, key)  # (b, h_kv, gq, slots)
    if attention_mask is not None:  # (b, 1 or heads, q, slots + ...): to (b, 1 or h_kv, gq, slots)
        mask = attention_mask[..., : key.shape[-2]]
        mask = mask.reshape(b, h_kv, gq, -1) if mask.shape[1] == h else mask.repeat(1, 1, gq // q, 1)
        own = own.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else own + mask
    at = lanes.head[:, :, None].expand(-1, -1, gq)  # (b, lanes, gq): each lane's head
    wide = at[..., None].expand(-1, -1, -1, d)
    lane = logits(qg.gather(1, wide), lanes.keys).masked_fill_(~lanes.valid[:, :, None, :], float("-inf"))
    top = own.amax(-1).scatter_reduce_(1, at, lane.amax(-1), "amax")  # (b, h_kv, gq): each head's largest
    if q > 1:  # (a padding query sees nothing; a step's query sees its own token)
        top.masked_fill_(top == float("-inf"), 0.0)
    # Logits far below their head's largest are floored at e^-80 of it: their exp would be a subnormal float,
    # on which a CPU's exp and products run some 10x slower (measured: exp and a product of 30k, 0.2 ms against
    # 2 ms); 1e-35 of a weight is none.
    own = own.sub_(top[..., None]).clamp_min_(FLOOR).exp_()
    lane = lane.sub_(top.gather(1, at)[..., None]).clamp_min_(FLOOR).exp_()
    total = own.sum(-1).scatter_add_(1, at, lane.sum(-1))
    out = torch.matmul(own, as_float(value)).scatter_add_(1, wide, torch.matmul(lane, as_float(lanes.values)))
    out = out.div_(total[..., None])
    return out.view(b, h, q, d).transpose(1, 2).contiguous().to(value.dtype), None


# The attention implementations sparsekv runs inside its own (`sparsekv_implementation`): flash attention takes
# a mask of its own form and is for GPUs, where a press that reads a step's attention recomputes it.
WRAPPED = ("sdpa", "eager")
_PREFIX = "sparsekv_"  # of the wrapped implementations' names: "sparsekv_sdpa", "sparsekv_eager"


def model_implementation(name: str) -> str:
    """The model's own attention implementation behind `name` (a model's `config._attn_implementation`, which
    is sparsekv's `sparsekv_implementation` name inside a press's `with` block)."""
    return name.removeprefix(_PREFIX)


def module_implementation(module) -> str:
    """The model's own attention implementation at `module`, a model or one of its modules (`model_implementation`
    of its config's)."""
    return model_implementation(module.config._attn_implementation)


def reads_lanes(model) -> bool:
    """Whether `model`'s attention reads lanes inside a press's `with` block: its own implementation is one of
    `WRAPPED`, which the block runs inside sparsekv's (`sparsekv_implementation`). Whether the block is open yet or
    not: a recorded prefill compresses outside it (`Prefill.compress`), and a cache continues only inside one."""
    return module_implementation(model) in WRAPPED


def sparsekv_implementation(name: str) -> str | None:
    """The attention implementation that runs the model's own (`name`) and, at a layer's call given them by
    sparsekv's hooks, computes softmax attention itself: over a layer's lanes too (the `lanes` keyword:
    `lane_attention`), or to return its weights (the `keep_weights` keyword:
    `attention_with_weights`). Registered with transformers' `AttentionInterface` (and the mask function of
    `name`) under its own name, which it returns. None where `name` is not one of `WRAPPED`."""
    if name not in WRAPPED:
        return None
    wrapped = _PREFIX + name
    if wrapped not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        inner = ALL_ATTENTION_FUNCTIONS.get_interface(name, None)  # None: "eager" (each model has its own)

        def attention(module, query, key, value, attention_mask, keep_weights: bool = False,
                      lanes: Lanes | None = None, **kwargs):
            if lanes is not None:
                return lane_attention(module, query, key, value, attention_mask, lanes, **kwargs)
            # (attention sinks, `s_aux`, which no model sparsekv serves has: the model's own, weights computed again)
            if keep_weights and not module.training and kwargs.get("s_aux") is None:
                return attention_with_weights(module, query, key, value, attention_mask, **kwargs)
            # (eager: the model's own function, from its modeling module, as its attention modules call it)
            own = inner or sys.modules[type(module).__module__].eager_attention_forward
            return own(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(wrapped, attention)
        AttentionMaskInterface.register(wrapped, ALL_MASK_ATTENTION_FUNCTIONS[name])
    return wrapped


def attention_with_weights(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention computed once, for its output and its weights: `(output (batch, q, heads, head_dim),
    weights (batch, heads, q, keys) float32)`, as transformers' attention functions return them.

    The weights are `attention_probs`' (float32, as a press reads them), their product with the values in the
    values' dtype. `attention_mask` is boolean (True: attended) or additive (eager's), `(batch, 1 or heads, q,
    keys)`, or None."""
    b, h, q, _ = query.shape
    h_kv = key.shape[1]
    mask = attention_mask
    if mask is not None:  # as `attention_probs` takes it: `(batch, kv_heads or 1, group or 1, q, keys)`
        mask = mask[..., : key.shape[-2]]
        mask = mask.unflatten(1, (h_kv, -1)) if mask.shape[1] == h else mask[:, :, None]
    scaling = module.scaling if scaling is None else scaling
    weights = attention_probs(module, query * scaling, key, mask)  # (batch, kv_heads, group, q, keys)
    output = torch.bmm(weights.to(value.dtype).view(b * h_kv, -1, weights.shape[-1]), value.flatten(0, 1))
    return output.view(b, h, q, -1).transpose(1, 2).contiguous(), weights.view(b, h, q, -1)


@dataclass
class AttentionCall:
    """One call of an attention module, as the hooks saw it.

    Attributes:
        module: the attention module (gives `layer_idx`, `head_dim`, `scaling`, projections).
        hidden_states: its input `(batch, q, hidden)`.
        position_embeddings: `(cos, sin)` of the input tokens; None for a layer without position embeddings.
        input_valid: `(batch, q)` which input tokens are real, or None when all are.
        projected: the query projection's output for this input, when the hooks captured it (decoding steps of
            presses that read queries then); `queries()` then shapes it instead of recomputing it.
        capture: whether this call captures its projection (set by the cache: after the prompt, for presses
            that read step queries).
        weights: the softmax attention the call computed, `(batch, heads, q, keys)` float32, when it kept it (a
            forward after the prompt under a press that reads its attention, `SparseCache.keeps_weights`): what
            `Context.attention` reads instead of computing it again.
        offset: the input's first token's index in the prompt, when the call stands for a prompt read in pieces
            (the last piece and the tail of the earlier ones before it, `SparseCache` and `Press.prompt_tail`):
            `queries(start, end)` and `valid()` then count tokens from the prompt's start, and `input_valid` and
            `position_embeddings` cover the prompt from its start (`hidden_states` its last tokens only).
    """

    module: torch.nn.Module
    hidden_states: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    input_valid: torch.Tensor | None
    projected: torch.Tensor | None = None
    capture: bool = False
    offset: int = 0
    weights: torch.Tensor | None = None

    @property
    def q_len(self) -> int:
        return self.hidden_states.shape[1]

    def queries(self, start: int = 0, end: int | None = None, grouped: bool = False,
                scaled: bool = False) -> torch.Tensor:
        """Rotated queries of input tokens `start:end`, `(batch, heads, tokens, head_dim)`; `grouped`: summed
        over each KV head's query heads, `(batch, kv_heads, tokens, head_dim)`; `scaled`: multiplied by the
        module's attention scaling (as attention's logits use them)."""
        if self.projected is not None and start == 0 and end is None:  # every token: nothing to cut (a step)
            q = shape_queries(self.module, self.projected, self.position_embeddings, grouped)
        else:
            if start < self.offset:
                raise ValueError(f"sparsekv: the press reads prompt token {start}'s queries, but a prompt read in "
                                 f"pieces keeps the layer inputs of its tokens from {self.offset} on only; "
                                 "`Press.prompt_tail` must cover every token `compress` reads.")
            sl = slice(start - self.offset, None if end is None else end - self.offset)  # the inputs'
            rope = None if self.position_embeddings is None else \
                tuple(t[:, start:end] for t in self.position_embeddings)  # from the prompt's start, as `valid()`
            if self.projected is not None:
                q = shape_queries(self.module, self.projected[:, sl], rope, grouped)
            else:
                q = project_queries(self.module, self.hidden_states[:, sl], rope, grouped)
        return q * self.module.scaling if scaled else q

    def valid(self) -> torch.Tensor:
        """`(batch, q)` validity of the input tokens (`(batch, offset + q)` from the prompt's start: `offset`)."""
        if self.input_valid is not None:
            return self.input_valid.to(self.hidden_states.device)
        b, n = self.hidden_states.shape[:2]
        return torch.ones(b, self.offset + n, dtype=torch.bool, device=self.hidden_states.device)

    def prefill_probs(self, keys: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Attention of prefill queries `start:end` over the prompt `keys` (causal, padding masked).

        Returns `(batch, kv_heads, group, end - start, end)`: causality means these queries see no key past
        `end`, so those are left out. Rows of padding queries are zero.
        """
        if self.input_valid is None:  # no padding: each query sees every key before the block, and its own
            block = torch.arange(start, end, device=keys.device)
            causal = block[None, :] <= block[:, None]  # (q, q) over the block's own keys
            queries = self.queries(start, end, scaled=True)
            return attention_probs(self.module, queries, keys[..., :end, :], causal, mask_from=start)
        valid = self.valid()
        causal = torch.arange(end, device=keys.device)[None, :] <= torch.arange(start, end, device=keys.device)[:, None]
        return self.probs(keys[..., :end, :], causal[None] & valid[:, None, :end], start, end)

    def probs(self, keys: torch.Tensor, mask: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Attention of input queries `start:end` over `keys`, `(batch, kv_heads, group, q, k)`.

        `mask` `(batch, q, k)`, or per KV head `(batch, kv_heads, q, k)`, says which keys each query may see;
        padding queries get zero rows. None: every query sees every key.
        """
        queries = self.queries(start, end, scaled=True)
        if mask is not None:  # (batch, kv_heads or 1, group, q, k)
            mask = mask[:, :, None] if mask.dim() == 4 else mask[:, None, None]
        if self.input_valid is None:  # every query is real (a decoding step's always): the mask as given
            return attention_probs(self.module, queries, keys, mask)
        valid = self.valid()[:, None, None, start:end, None]  # broadcast over heads and keys
        return attention_probs(self.module, queries, keys, valid if mask is None else mask & valid)
