"""KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction")."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..attention import project_queries
from ..context import Context
from ..layers import KVLayer
from ..options import check_number
from ..probe import ProbeCache
from ..state import RowState
from .floored import FlooredScorerPress

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass
class KVzipState(RowState):
    """The prompt's token ids `(batch, read)`, every piece's (generate's `prefill_chunk_size`), until the
    reconstruction reads them (`after_prompt`); None after."""

    prompt_ids: torch.Tensor | None = None
    read: bool = False  # the prompt is reconstructed: later forwards are not the prompt's


@dataclass(kw_only=True)
class KVzipPress(FlooredScorerPress):
    """Keep the KV the model reads most while it *reconstructs* the prompt: query-agnostic, so that one
    compressed context serves any later question.

    Once the prompt is in, the model is run again on "Repeat the previous context exactly." followed by the
    prompt itself, as the start of its own reply, reading the prompt's cache (KVzip sec. 3). Each prompt token is
    scored, per KV head, by the most attention any reconstructing query of its head's group pays it, softmax over
    the attention sinks, the chunk being reconstructed and the reconstruction so far. The budget is then shared
    across all layers and heads together (the top `budget x kv_heads x layers` scores of each row; KVzip's
    non-uniform budgets), the first `n_sink` tokens always kept. Decoding keeps every generated token.

    The reconstruction costs about one more prefill (the prompt read again, in `chunk_size` pieces, each
    attending the whole prompt); `sparsekv eval` shares it between the ratios of one prompt.

    Where sparsekv chose (the paper and kvpress 0.5.5 agree otherwise): the prompt's chat-template head (before the
    user's text) is not reconstructed and scores 0, as in kvpress, when the prompt starts with it; a prompt made
    without the template is reconstructed whole. Rows of a padded batch are reconstructed one by one, each over
    its own tokens. The scores are kept by the core (`after_prompt`): a layer's heads keep different numbers of
    tokens, which it holds as AdaKV's head-wise budgets are held (lanes, `sparsekv.lanes`).

    Args:
        tokenizer: the model's tokenizer (required: the reconstruction's instruction is text, in its chat template).
        ratio: fraction of each prompt's KV kept, over all layers and heads together, in (0, 1].
        budget: tokens kept per prompt, per layer and head on average (at least `min_budget` and `n_sink`).
        min_budget: the fewest tokens a row keeps (default 64, sparsekv's, as its other kvpress scorers: a chat
            turn is kept whole; kvpress and the paper keep the sinks alone).
        layerwise: each layer keeps its own share (its heads still share it by score; kvpress's `layerwise`).
            Default False: one budget across layers, as KVzip.
        n_sink: first tokens always kept, the attention sinks (default 4, kvpress's).
        chunk_size: prompt tokens reconstructed per forward (default 2048, kvpress's; the paper's 2K chunks).
    """

    tokenizer: Any = field(default=None, repr=False, compare=False, kw_only=False)
    layerwise: bool = False
    n_sink: int = 4
    chunk_size: int = 2048
    reads_input_ids: ClassVar[bool] = True
    compiled_decoding: ClassVar[bool] = True  # its steps append only (a compiled cache's free slots)

    def __post_init__(self):
        name = type(self).__name__
        if self.tokenizer is None:
            raise ValueError(f"{name}: tokenizer is required (the model's tokenizer, for the reconstruction's "
                             f"instruction): {name}(tokenizer, ratio=0.25).")
        if not isinstance(self.layerwise, bool):
            raise TypeError(f"{name}: layerwise must be True or False; got {self.layerwise!r}.")
        self.n_sink = check_number(name, "n_sink", self.n_sink, integer=True, low=0, unit="tokens")
        self.chunk_size = check_number(name, "chunk_size", self.chunk_size, integer=True, low=1, unit="tokens")
        super().__post_init__()  # ratio or budget, min_budget, the floor

    def min_kept(self) -> tuple[int, str]:
        if self.n_sink > self.min_budget:
            return self.n_sink, f"n_sink={self.n_sink}"
        return self.min_budget, f"min_budget={self.min_budget}"

    def prompt_tail(self) -> int | None:
        return 0  # `compress` reads nothing: a prompt read in pieces is reconstructed once all is in

    def new_state(self, cache) -> KVzipState:
        return KVzipState()

    def begin_forward(self, ctx: Context) -> None:
        state, ids = ctx.state, ctx.forward.input_ids
        if not state.read:  # the prompt, or a piece of it
            state.prompt_ids = ids if state.prompt_ids is None else torch.cat([state.prompt_ids, ids], 1)

    def compress(self, ctx: Context) -> None:
        """Each layer keeps the whole prompt until every layer has it (`after_prompt`)."""

    def after_prompt(self, ctx: Context, model: torch.nn.Module) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        ids, ctx.state.prompt_ids, ctx.state.read = ctx.state.prompt_ids, None, True
        budgets = self.row_budgets(ctx)
        if budgets is None:  # every prompt kept whole
            return {}
        layers = [i for i, layer in enumerate(ctx.cache.layers) if isinstance(layer, KVLayer)]
        start = ctx.prompt_start.tolist()
        words = self.instruction()
        if max(int(ids.max()), *(i for part in words for i in part)) >= model.get_input_embeddings().num_embeddings:
            raise ValueError(f"{type(self).__name__}: the tokenizer's ids exceed the model's vocabulary; give the "
                             "press the model's own tokenizer.")
        width = ids.shape[1]  # the prompt's slots, left padding first
        scores = torch.full((len(layers), len(start), ctx.cache.layers[layers[0]].keys.shape[1], width),
                            float("-inf"))
        for b, s in enumerate(start):  # each row's prompt reconstructed alone, its scores at its real slots
            row = ctx.prompt_work(("kvzip", self.n_sink, self.chunk_size, b),
                                  lambda b=b, s=s: self.reconstruction_scores(model, ctx.cache, ids[b, s:], b, words))
            scores[:, b, :, s:] = torch.stack(row).cpu()
        keep = self.head_budgets_by_layer(scores, budgets)  # (layers, batch, heads)
        device = {i: ctx.cache.layers[i].keys.device for i in layers}
        return {i: (scores[j].to(device[i]), keep[j].to(device[i])) for j, i in enumerate(layers)}

    def head_budgets_by_layer(self, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """Tokens each layer's heads keep, `(layers, batch, heads)`, from the scores `(layers, batch, heads,
        prompt)` (-inf past a row's prompt): each row's top `budget x heads x layers` scores counted per layer and
        head (`layerwise`: its top `budget x heads` in each layer)."""
        n_layers, batch, heads, _ = scores.shape
        counts = torch.zeros(n_layers, batch, heads, dtype=torch.long)
        for b in range(batch):
            row = scores[:, b]
            if self.layerwise:
                flat, k = row.reshape(n_layers, -1), min(int(budgets[b]) * heads, row[0].numel())
                chosen = flat.topk(k, dim=-1).indices  # (layers, k)
                counts[:, b] = torch.stack([torch.bincount(c // row.shape[-1], minlength=heads) for c in chosen])
            else:
                k = min(int(budgets[b]) * heads * n_layers, row.numel())
                chosen = row.reshape(-1).topk(k).indices // row.shape[-1]  # (layer, head) of each kept token
                counts[:, b] = torch.bincount(chosen, minlength=n_layers * heads).view(n_layers, heads)
        return counts

    # --- the reconstruction -----------------------------------------------------------------------------------
    def instruction(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """Token ids, tokenized once per prompt: the chat template's head (before the user's text) and tail
        (after it, up to the reply), without a template no head and a newline (kvpress's); the first chunk's
        instruction, and a later chunk's."""
        tok = self.tokenizer
        ids = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
        if not getattr(tok, "chat_template", None):
            head, tail = [], ids("\n")
        else:
            dummy, separator = "dummy context", "\n" + "#" * 13
            text = tok.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                           add_generation_prompt=True, tokenize=False)
            head, tail = text.split(separator)
            head, tail = ids(head.split(dummy)[0]), ids(tail)
        return head, tail, ids(FIRST), ids(LATER)

    def reconstruction_scores(self, model, cache, ids: torch.Tensor, row: int, words: tuple) -> list[torch.Tensor]:
        """Per compressed layer of `cache`, `(kv_heads, n)` the score of each of the row's `n` real prompt tokens
        `ids`: the most attention a reconstructing query pays it (0 for the template's head, +inf for the sinks);
        `words` the `instruction`'s ids."""
        n = ids.shape[0]
        head, tail, first, later = words
        offset = len(head) if ids[:len(head)].tolist() == head else 0
        layers = {i: layer for i, layer in enumerate(cache.layers) if isinstance(layer, KVLayer)}
        scores = {i: layer.keys.new_zeros(layer.keys.shape[1], n, dtype=torch.float32) for i, layer in layers.items()}
        chunk: dict = {}

        def before(module, hidden, rope):
            chunk["hidden", module.layer_idx], chunk["rope", module.layer_idx] = hidden, rope

        def after(module):
            i = module.layer_idx
            if i not in layers:
                return
            view = chunk["cache"].layers[i]
            keys = view.keys  # the prompt's, then the reconstruction's own
            view.keys, view.values = view.keys[:, :, :n], view.values[:, :, :n]  # (released: the prompt's KV again)
            queries = project_queries(module, chunk["hidden", i], chunk["rope", i])
            s, e = chunk["span"]
            scores[i][:, s:e] = self.chunk_scores(module, queries, keys, s, e, n)

        def prompt_only() -> ProbeCache:
            """The row's prompt as a transformers cache whose layers' events come here: its real slots viewed
            (the prompt is held whole, in order), a layer sparsekv leaves alone (sliding-window) copied, as its
            last `n` tokens at most."""
            view = ProbeCache(model.config, before, after)
            for i, layer in enumerate(cache.layers):
                if i not in layers:
                    view.layers[i] = copy.copy(layer)
                    view.layers[i].cumulative_length = n
                view.layers[i].lazy_initialization(layer.keys[row:row + 1], layer.values[row:row + 1])
                width = n if i in layers else min(layer.keys.shape[-2], n)
                view.layers[i].keys = layer.keys[row:row + 1, :, -width:]
                view.layers[i].values = layer.values[row:row + 1, :, -width:]
            return view

        decoder = model.get_decoder()
        for s in range(offset, n, self.chunk_size):
            e = min(s + self.chunk_size, n)
            ask = first if s == offset else later + ids[max(offset, s - 8):s].tolist()  # kvpress: its last 8 tokens
            probe = torch.cat([torch.tensor([ask + tail], device=ids.device), ids[None, s:e]], dim=1)
            chunk["span"], chunk["cache"] = (s, e), prompt_only()
            positions = torch.arange(n, n + probe.shape[1], device=ids.device)[None]
            decoder(input_ids=probe, position_ids=positions, cache=chunk["cache"], use_cache=True)
        for i in layers:
            scores[i][:, :self.n_sink] = float("inf")
        return [scores[i] for i in layers]

    def chunk_scores(self, module, queries: torch.Tensor, keys: torch.Tensor, s: int, e: int, n: int
                     ) -> torch.Tensor:
        """`(kv_heads, e - s)`: the most attention a reconstructing query `queries` `(1, heads, q, head_dim)` pays
        each prompt token `s:e`, its softmax over the sinks, those tokens and the reconstruction (causal);
        `keys` `(1, kv_heads, n + q, head_dim)` the prompt's then the reconstruction's."""
        q, group = queries.shape[2], queries.shape[1] // keys.shape[1]
        sink = min(self.n_sink, s)
        read = torch.cat([keys[:, :, :sink], keys[:, :, s:e], keys[:, :, n:]], dim=2)  # (1, h_kv, m, d)
        h_kv, d = read.shape[1], read.shape[-1]
        grouped = queries.view(1, h_kv, group, q, d).float()
        scale = getattr(module, "scaling", None) or 1 / math.sqrt(d)
        logits = grouped @ read.float()[:, :, None].transpose(-1, -2) * scale  # (1, h_kv, group, q, m)
        own = torch.ones(q, q, dtype=torch.bool, device=logits.device).triu(1)  # later reconstruction tokens
        logits[..., -q:] = logits[..., -q:].masked_fill(own, float("-inf"))
        return logits.softmax(-1)[..., sink:sink + e - s].amax(dim=(2, 3))[0]
