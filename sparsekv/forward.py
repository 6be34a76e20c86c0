"""The forward under way: what the layers of one model forward share, a home of per-generation state that lives
from `SparseCache.begin_forward` to `end_forward` (`sparsekv.cache` drives it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .attention import AttentionCall


@dataclass
class Forward:
    """What the layers of one model forward share, from `begin_forward` to `end_forward`.

    Attributes:
        input_ids: the forward's token ids `(batch, q)`, None when the model gets embeddings.
        input_valid: `(batch, q)` which input tokens are real; None when all are (the common, fast case).
        q_len: tokens in this forward.
        first: the cache's first forward (it holds nothing before this one's tokens): the prompt, or its first
            piece.
        calls: per layer index, the attention call under way (from `before_layer` to `after_layer`).
        plan: a press's plan for every layer of this forward, made once: in its `begin_forward` (e.g.
            SentenceKV's sentence-closing flags) or by the first layer that needs it; None when it has none. Gone
            with the forward.
        victims: a decoding step's victim slots `(batch, heads)`, found at its first layer for every layer: when a
            press's scores are the same in every layer (`Press.hold_budget`, `shared_by_layers`), or the free slot
            of a step's token when every layer holds one layout (`SparseCache.one_layout`).
        mask: the attention mask of a decoding step's every layer when they hold one layout
            (`SparseCache.one_layout`), built at its first layer; None otherwise.
        draft: the forward's tokens are a draft being verified (assisted decoding, prompt lookup), which a crop may
            take back.
        continues_prompt: several new tokens after the first forward that are not a draft being verified: a
            prompt continued (generate on a cache that holds part of its input, a question asked of a
            compressed context, a caller's own multi-token forward).
        own_masks: every layer gets the mask of its own layout (`masks.physical_mask`), not the forward's: a
            forward of several tokens after the first, whose mask came built for the layout before the forward
            began (generate's 4D masks for a compiled cache), which a press may change then (CHESS reads its
            stores for a continued prompt).
    """

    input_ids: torch.Tensor | None
    input_valid: torch.Tensor | None
    q_len: int
    first: bool = False
    draft: bool = False
    continues_prompt: bool = False
    own_masks: bool = False
    calls: dict[int, AttentionCall] = field(default_factory=dict)
    plan: Any = None
    victims: torch.Tensor | None = None
    mask: Any = None
    pieces_left: int = 0  # a piece of a prompt read in pieces: how many follow (`PromptPieces`)
