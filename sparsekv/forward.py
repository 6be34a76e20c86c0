"""The forward under way: what the layers of one model forward share, a home of per-generation state that lives
from `SparseCache.begin_forward` to `end_forward` (`sparsekv.cache` drives it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .context import Context


@dataclass
class Forward:
    """What the layers of one model forward share, from `begin_forward` to `end_forward`.

    Attributes:
        input_ids: the forward's token ids `(batch, q)`, None when the model gets embeddings.
        input_valid: `(batch, q)` which input tokens are real; None when all are (the common, fast case).
        q_len: tokens in this forward.
        first: the cache's first forward (it holds nothing before this one's tokens): the prompt, or its first
            piece.
        contexts: per layer index, the layer's `Context` under way (its attention call; from `before_layer` to
            `after_layer`).
        plan: a press's plan for every layer of this forward, made once, by the first layer that needs it (H2O's
            recent window, CHESS's RoPE table); None when it has none. Gone with the forward.
        victims: a decoding step's victim slots `(batch, heads)`, found at its first layer for every layer, when a
            press's step scores are the same in every layer (`Press.scores_by_position`).
        masks: per layout (`SparseCache.layouts`), the attention mask of a decoding step's layers of that layout,
            built at the first of them.
        step_slots: per layout, the free slot `(batch, heads)` a decoding step's token takes in its layers (a
            press that keeps every token), found at the first of them.
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
    contexts: dict[int, Context] = field(default_factory=dict)
    plan: Any = None
    victims: torch.Tensor | None = None
    masks: dict[int, Any] = field(default_factory=dict)
    step_slots: dict[int, torch.Tensor] = field(default_factory=dict)
    pieces_left: int = 0  # a piece of a prompt read in pieces: how many follow (`PromptPieces`)
    logits_read: bool = False  # the press's `end_forward` has had the logits (`SparseCache.after_head`)


def check_inputs(cache, input_ids: torch.Tensor | None, unreadable: bool, q_len: int, batch: int, first: bool,
                 piece: bool) -> None:
    """Refuse a forward `cache` cannot serve, before it opens (`SparseCache.begin_forward`), naming what to do.
    `unreadable`: its attention mask is 4D (generate's for a compiled cache); `first`: the cache's first forward;
    `piece`: a later piece of a prompt read in pieces."""
    if unreadable and not first and not piece and batch > 1 and q_len > 1:
        raise ValueError("attention_mask: a compiled cache's batch cannot be continued with several tokens a row "
                         "(generate gives it a 4D mask, in which their padding cannot be read); continue it one "
                         "row at a time (`cache.batch_select_indices`), or use a cache made without compiled.")
    if first and q_len == 0:
        raise ValueError("input_ids: the prompt is empty; give at least one token (a chat template's, or the "
                         "tokenizer's bos_token_id).")
    if not first and batch != cache.prompt_lengths.shape[0]:
        raise ValueError(
            f"cache: it holds {cache.prompt_lengths.shape[0]} rows and this forward has {batch}. generate expands "
            "its inputs for num_beams or num_return_sequences, not a cache given to it: expand that cache the "
            "same way first (`cache.batch_repeat_interleave(n)`).")
    if cache.press.reads_input_ids and input_ids is None:
        raise ValueError(f"{type(cache.press).__name__}: needs input_ids (it reads the tokens), not inputs_embeds.")
    if input_ids is not None and (input_ids.is_floating_point() or input_ids.dtype == torch.bool):
        raise ValueError(f"input_ids: token ids must be integers (torch.long); got {input_ids.dtype}.")
