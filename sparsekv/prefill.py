"""One prompt forward, many presses: prefill once, then compress the same prompt with each press.

A press compresses a layer *after* that layer's attention ran over the whole prompt, so the prompt's forward
pass (hidden states, keys, values, next-token logits) is the same under every press. `Prefill.run` records it
once, without a press; `Prefill.compress(press)` replays the press's prefill work layer by layer on the
recording and returns the very cache `model.generate` would have built under the press; `Prefill.generate`
continues greedy decoding from it. A sweep of presses x ratios then costs one prompt forward per sample instead
of one per configuration (`sparsekv eval` works this way), and the answers are the same token for token (tested).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import Cache, DynamicCache, GenerationConfig

from .architectures import attention_modules, compressed_layers
from .cache import SparseCache
from .hooks import installed
from .join import check_joins_rows, join_layers


@dataclass
class Prefill:
    """A recorded prompt forward.

    Attributes:
        input_ids, attention_mask: the prompt `(batch, L)` (left padding marked in the mask).
        logits: next-token logits after the prompt, `(batch, 1, vocab)`.
        cache: the full (uncompressed) `DynamicCache` of the prompt.
        inputs: per compressed layer, the attention module's input: `(hidden_states, (cos, sin))`.
        shared: results of presses' prompt-only work (`Context.prompt_work`), reused by later replays.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits: torch.Tensor
    cache: DynamicCache
    inputs: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]
    model: torch.nn.Module
    shared: dict = field(default_factory=dict)

    @classmethod
    @torch.no_grad()
    def run(cls, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Prefill:
        """Run the prompt through `model` once (no press may be installed) and record what presses need."""
        if installed(model):
            raise ValueError("model: record the prefill outside `with press(model):`; it must run uncompressed.")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        modules = attention_modules(model)
        inputs, handles = {}, []

        def record(layer_idx, module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            inputs[layer_idx] = (hidden, kwargs.get("position_embeddings"))

        try:
            for i in compressed_layers(model.config):
                handles.append(modules[i].register_forward_pre_hook(partial(record, i), with_kwargs=True))
            cache = DynamicCache(config=model.config)
            out = model(input_ids, attention_mask=attention_mask, position_ids=prompt_positions(attention_mask),
                        cache=cache, logits_to_keep=1)
        finally:
            for handle in handles:
                handle.remove()
        return cls(input_ids, attention_mask, out.logits, cache, inputs, model)

    @torch.no_grad()
    def compress(self, press) -> SparseCache:
        """The cache `press` builds on this prompt: the same as after `generate`'s prefill under the press."""
        cache = press.make_cache(self.model)
        b, q = self.input_ids.shape
        cache.shared = self.shared
        # The events of the prompt's forward, in the driver's order (`sparsekv.cache`), on the recording.
        cache.begin_forward(self.input_ids, self.attention_mask, q, b)
        modules = attention_modules(self.model)
        for i, recorded in enumerate(self.cache.layers):
            if i not in self.inputs:  # a layer sparsekv leaves alone (sliding window): transformers' own state
                cache.layers[i] = copy.deepcopy(recorded)
                continue
            hidden, position_embeddings = self.inputs[i]
            cache.before_layer(modules[i], hidden, position_embeddings)
            cache.update(recorded.keys, recorded.values, i)
            cache.after_layer(i)
        cache.end_forward(self.logits, self.model)
        cache.shared = None  # the prompt is done: the cache keeps no reference to the recording
        return cache

    @torch.no_grad()
    def generate(self, press=None, generation_config: GenerationConfig | None = None, *,
                 cache: SparseCache | None = None, **kwargs) -> torch.Tensor:
        """Greedy continuation of the prompt under `press` (None: the full cache), as `model.generate` gives it.

        Returns `(batch, L + new)` ids like `generate`. Installs the press for the decoding steps unless it is
        installed already. Only greedy decoding without logits processors: the first token is the argmax of
        the recorded logits. `cache`: this prompt's `compress(press)` (or, with no press, a copy of `self.cache`),
        when the caller made it (to read it afterwards: it is decoded in place); made here otherwise.
        """
        config = copy.deepcopy(generation_config or self.model.generation_config)
        config.update(**kwargs)
        if config.do_sample or (config.num_beams or 1) > 1:
            raise ValueError("generation_config: Prefill.generate decodes greedily; do_sample must be False and "
                             "num_beams 1.")
        first = self.logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([self.input_ids, first], dim=1)
        new_tokens = config.max_new_tokens if config.max_new_tokens is not None else 20
        eos = config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        done = torch.isin(first[:, 0], torch.tensor(eos, dtype=first.dtype, device=first.device))
        if new_tokens <= 1 or bool(done.all()):
            return ids
        config.max_new_tokens = new_tokens - 1
        mask = torch.cat([self.attention_mask, torch.ones_like(first)], dim=1)
        if press is None:
            out = self.model.generate(ids, attention_mask=mask, generation_config=config,
                                      cache=copy.deepcopy(self.cache) if cache is None else cache)
        else:
            cache = cache if cache is not None else self.compress(press)
            with nullcontext() if installed(self.model) else press(self.model):
                out = self.model.generate(ids, attention_mask=mask, cache=cache, generation_config=config)
        if bool(done.any()):  # rows whose first token ended them: padding after it, as generate pads
            pad = config.pad_token_id if config.pad_token_id is not None else eos[0]
            out[done, ids.shape[1]:] = pad
        return out



@torch.no_grad()
def generate_from(model, press, cache, input_ids: torch.Tensor, generation_config: GenerationConfig,
                  copy_cache: bool = True) -> torch.Tensor:
    """`model.generate` on `input_ids` `(1, L)` whose first tokens `cache` already holds (a context prefilled
    under `press`, None: no press), decoding under `press`. By default `cache` itself is left as it is: a copy is
    decoded, so several continuations can start from one compressed context; `copy_cache=False` decodes `cache`
    itself (one continuation, read afterwards)."""
    with nullcontext() if press is None or installed(model) else press(model):
        return model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                              cache=copy.deepcopy(cache) if copy_cache else cache, generation_config=generation_config)


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position `(batch, L)` as `generate` gives it: counted from its row's first real token (0 for
    the padding before it). A model called without them counts from the first column, padding included."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


@torch.no_grad()
def prefill_rows(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 rows_at_once: int = 1) -> Cache:
    """The cache of a batch of prompts, prefilled `rows_at_once` rows at a time and joined, holding every prompt
    token but the last: compressed by the press installed on `model` (`SparseCache.join`), or the full cache
    when none is.

    A press keeps a fraction of each prompt's KV, but a batch prefilled together first holds every row's whole
    prompt (and its activations) at once: that peak, not the compressed KV, caps the batch that fits. Prefilled
    apart, the peak is one group's prefill beside the compressed KV of the rows done (joined layer by layer, each
    row's layer released once joined), so the batch that fits grows with the compression. Continue with the
    whole prompts, e.g. `model.generate(input_ids, attention_mask=attention_mask, cache=cache, ...)`: generate
    reads the last prompt token as its first step, and decodes the rows together. The rows keep the tokens a
    batch prefilled together on all but the last token would keep (tested); any generation mode runs on the
    result (for beams, expand it first: `cache.batch_repeat_interleave(num_beams)`). SnapKV, ChunkKV,
    StreamingLLM, H2O, SentenceKV (its offload stores stay on the host) and head-wise budgets (AdaKV: each row's
    heads in lanes, the batch's in lanes again) join; CHESS refuses.

    Args:
        model: a model, with a press installed (`with press(model):`) whose press declares `joins_rows`, or none.
        input_ids: `(batch, L)` prompts, left-padded to one length, at least 2 tokens.
        attention_mask: `(batch, L)` 1 for real tokens, 0 for padding (default: every token real).
        rows_at_once: rows prefilled together (default 1: the lowest peak).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError("input_ids: a (batch, length) tensor of at least 2 tokens; got shape "
                         f"{tuple(input_ids.shape)}.")
    if isinstance(rows_at_once, bool) or not isinstance(rows_at_once, int) or rows_at_once < 1:
        raise ValueError(f"rows_at_once: an integer >= 1 (rows prefilled together); got {rows_at_once!r}.")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    short = attention_mask[:, :-1].sum(-1) == 0
    if bool(short.any()):
        raise ValueError(f"attention_mask: row {int(short.int().argmax())} has fewer than 2 real tokens, and "
                         "prefill_rows holds every prompt token but the last: drop the row, or prefill the batch "
                         "together (generate it without a cache).")
    caches, positions = [], prompt_positions(attention_mask[:, :-1])
    for start in range(0, input_ids.shape[0], rows_at_once):
        rows = slice(start, start + rows_at_once)
        cache = model(input_ids[rows, :-1], attention_mask=attention_mask[rows, :-1], position_ids=positions[rows],
                      use_cache=True, logits_to_keep=1).cache
        caches.append(cache)
        if isinstance(cache, SparseCache) and rows.stop < input_ids.shape[0]:
            check_joins_rows(cache.press)  # before the other rows are prefilled
    if len(caches) == 1:
        return caches[0]
    # The caches are this function's own: each layer is released once joined (the KV is never held twice).
    if isinstance(caches[0], SparseCache):
        return SparseCache.join(caches, consume=True)
    joined = copy.copy(caches[0])  # the full cache: transformers' layers, one tensor of keys and of values each
    joined.layers = join_layers(caches, consume=True)
    return joined
