"""A prompt read in several forwards (generate's `prefill_chunk_size`), kept until its last piece."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import AttentionCall
from .state import RowState


@dataclass
class PromptPieces(RowState):
    """A prompt read in several forwards (generate's `prefill_chunk_size`), until its last piece.

    The layers hold every piece's KV uncompressed; the press compresses at the last piece, as it would the whole
    prompt, from an `AttentionCall` that stands for it: the last piece's layer inputs after the last `tail` tokens'
    of the earlier pieces (`Press.prompt_tail`: what `compress` reads, e.g. SnapKV's window), with the validity and
    the RoPE table of the whole prompt. Only that tail is kept, never the prompt's activations; a press that reads
    every prompt query (H2O) reads each piece's as it comes (`Press.read_piece`).

    Attributes:
        tail: tokens of layer inputs kept from the earlier pieces.
        length: prompt tokens read so far (padding included).
        valid: `(batch, length)` which of them are real.
        rope: the `(cos, sin)` of those tokens, shared by the compressed layers (transformers gives them one).
        inputs: per layer index, the last `tail` tokens' hidden states.
    """

    tail: int
    length: int = 0
    valid: torch.Tensor | None = None
    rope: tuple | None = None
    inputs: dict = field(default_factory=dict)
    piece_rope: tuple | None = None  # the piece's own `(cos, sin)`, as the model gave it to its first layer

    def read(self, valid: torch.Tensor) -> None:
        """A piece's validity `(batch, q)`, before its layers run."""
        self.valid = valid if self.valid is None else torch.cat([self.valid, valid.to(self.valid.device)], dim=1)
        self.length = self.valid.shape[1]

    def call(self, call: AttentionCall) -> AttentionCall:
        """After a layer of a piece: the call standing for the prompt so far (the kept tail's inputs, then the
        piece's; validity and RoPE from the prompt's start), and the tail kept for the next piece."""
        if call.position_embeddings is None:  # a layer without position embeddings
            pass
        elif self.rope is None or self.rope[0].shape[1] < self.length:  # the piece's first rotary layer
            self.piece_rope = call.position_embeddings
            self.rope = call.position_embeddings if self.rope is None else tuple(
                torch.cat([a, b.to(a.device)], dim=1) for a, b in zip(self.rope, call.position_embeddings))
        elif call.position_embeddings[0] is not self.piece_rope[0]:
            raise ValueError(f"sparsekv: layer {call.module.layer_idx} got other position embeddings than the "
                             "first compressed layer: a prompt read in pieces keeps one RoPE table for them all.")
        kept = self.inputs.get(call.module.layer_idx)
        hidden = call.hidden_states if kept is None else torch.cat([kept, call.hidden_states.to(kept.device)], 1)
        self.inputs[call.module.layer_idx] = hidden[:, max(hidden.shape[1] - self.tail, 0):]
        rope = None if call.position_embeddings is None else tuple(t.to(hidden.device) for t in self.rope)
        return AttentionCall(call.module, hidden, rope, self.valid.to(hidden.device),
                             offset=self.length - hidden.shape[1])
