"""Installing a press on a model: forward hooks that hand each event of a forward to its cache, no patching.

The hooks hold no state of a generation: they find the generation's `SparseCache` in the forward's arguments
and call its driver (`SparseCache.begin_forward`, `before_layer`, `after_queries`, `after_layer`,
`end_forward`). The query projection's hook sees no cache argument; it reads the cache of the forward running in
its own thread (a thread-local of the installation), so concurrent generations on one model never meet.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from contextlib import contextmanager
from functools import partial

import torch
from transformers import DynamicCache

from .architectures import check_model
from .attention import query_projection
from .cache import KEEP_MASK, SparseCache
from .log import logger

_active: weakref.WeakSet = weakref.WeakSet()  # models with a press installed: presses do not nest


def _without_grad(hook):
    """`hook` under `torch.no_grad()` (press work never needs gradients), entered only when gradients are on:
    generate runs without them, and entering the context costs a few microseconds a call, at every layer of
    every step (a step's cost where the host is the bound: a GPU at batch 1)."""
    @functools.wraps(hook)
    def run(*args):
        if not torch.is_grad_enabled():
            return hook(*args)
        with torch.no_grad():
            return hook(*args)
    return run


class Installation:
    """One `with press(model):` block: the press, the model, and per thread the cache of the running forward."""

    def __init__(self, press, model):
        self.press, self.model = press, model
        self.running = threading.local()
        self.warned: set[str] = set()  # each warning once per block, not once per forward

    def warn(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            logger.warning(message)


@contextmanager
def install(press, model: torch.nn.Module):
    """Context manager behind `press(model)`: every hook is removed on exit, also on an exception."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{type(press).__name__}(...)(model): model must be a transformers model (a torch.nn.Module); "
                        f"got {type(model).__name__}.")
    targets = check_model(model)
    if model in _active:
        raise ValueError("model: a sparsekv press is already installed on this model; presses do not nest.")
    inst, handles = Installation(press, model), []
    _active.add(model)
    try:
        handles.append(model.register_forward_pre_hook(partial(_before_model, inst), with_kwargs=True))
        handles.append(model.register_forward_hook(partial(_after_model, inst), with_kwargs=True))
        for module in targets:
            handles.append(module.register_forward_pre_hook(_before_attention, with_kwargs=True))
            handles.append(module.register_forward_hook(_after_attention, with_kwargs=True))
            projection = query_projection(module) if press.reads_step_queries else None
            if projection is not None:  # a hook makes every call of the projection slower: only where it is read
                handles.append(projection.register_forward_hook(partial(_after_queries, inst, module.layer_idx)))
        yield model
    finally:
        for handle in handles:
            handle.remove()
        _active.discard(model)


def _before_model(inst: Installation, module, args, kwargs):
    inst.running.cache = None
    use_cache = kwargs.get("use_cache")
    if use_cache is False or (use_cache is None and not getattr(inst.model.config, "use_cache", True)):
        inst.warn("use_cache", f"sparsekv: use_cache=False: there is no KV cache to compress, so "
                               f"{type(inst.press).__name__} does nothing; leave use_cache on inside the `with` block.")
        return None
    # transformers >= 5.24 calls it `cache`; a caller's deprecated `past_key_values` is still renamed by forward.
    key = "past_key_values" if "past_key_values" in kwargs and "cache" not in kwargs else "cache"
    cache = kwargs.get(key)
    if cache is None or _fresh_default(cache):
        default, cache = cache, SparseCache(inst.press, inst.model.config)
        if default is not None and any(getattr(layer, "record_past", False) for layer in default.layers):
            cache.activate_past_recording()  # generate asked its cache to be croppable (drafts)
        kwargs[key] = cache
    elif not isinstance(cache, SparseCache):
        _refuse(inst, cache)
        return None
    elif cache.press != inst.press:
        raise ValueError(f"cache: it was built under {cache.press!r}, and this block installs {inst.press!r}; a "
                         "cache holds its press's selection and state, so continue it under the press that built it "
                         "(or start a new cache: pass none, or `press.make_cache(model)`).")
    if kwargs.get("output_attentions"):
        inst.warn("output_attentions", f"sparsekv: output_attentions under {type(inst.press).__name__}: a compressed "
                                       "layer's weights are over the slots its cache holds, in slot order "
                                       "(`cache.layers[i].positions` gives each slot's position), not over every "
                                       "position.")
    inputs = kwargs.get("input_ids", args[0] if args else None)
    shape = (inputs if inputs is not None else kwargs["inputs_embeds"]).shape
    draft = 0 if args else _draft_length(kwargs, cache, shape[1])  # generate passes keywords only
    if draft:
        kwargs = _prefill_before_draft(inst, module, kwargs, draft)
        inputs, shape = kwargs.get("input_ids"), (shape[0], draft)
    verifies = bool(draft) or _verifies_draft(kwargs, cache, shape[1])
    prompt = cache.prompt_lengths is None or cache.pieces is not None
    pieces_left = _pieces_left(inst) if shape[1] > 1 and prompt else 0
    cache.begin_forward(inputs, kwargs.get("attention_mask"), shape[1], shape[0], draft=verifies,
                        pieces_left=pieces_left)
    inst.running.cache = cache
    return args, kwargs


def _pieces_left(inst: Installation) -> int:
    """When this forward is a piece of a prompt that generate reads in several (`prefill_chunk_size`), how many
    pieces follow it; else 0. A press that cannot compress such a prompt refuses it (`Press.prompt_tail`),
    rather than compress its first piece alone, before the rest (the question) is read.

    A forward is not told that it is a piece, so this reads generate's own prefill (`GenerationMixin._prefill`, a
    frame up the stack: its `generation_config`, `input_chunks` and `chunk_idx`), once per prompt forward, never
    at a decoding step. Assisted decoding prefills without it, and does not read a prompt in pieces. (The generate
    mode tests compare a prompt in pieces with one forward for every press: a transformers that reads pieces
    otherwise fails them.)
    """
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != "_prefill":
        frame = frame.f_back
    return 0 if frame is None else pieces_after(inst.press, frame.f_locals)


def pieces_after(press, prefill: dict) -> int:
    """`_pieces_left` from the locals of generate's `_prefill` (`prefill`)."""
    size = getattr(prefill.get("generation_config"), "prefill_chunk_size", None)
    if size is None or press.reads_prompt_in_pieces:
        return 0  # no pieces, or the press reads them as a prompt and continued prompts itself
    chunks, index = prefill.get("input_chunks"), prefill.get("chunk_idx")
    if chunks is not None and len(chunks) < 2:
        return 0  # the prompt fits one piece
    if chunks is None or not isinstance(index, int):  # a transformers that names its pieces otherwise: never guess
        raise ValueError(f"sparsekv: cannot tell which piece of the prompt this forward is (generate's "
                         f"prefill_chunk_size={size}, this transformers version); leave prefill_chunk_size unset "
                         "inside `with press(model):`.")
    if press.prompt_tail() is None:
        raise ValueError(f"sparsekv: {type(press).__name__} cannot compress a prompt read in pieces, and generate's "
                         f"prefill_chunk_size={size} splits this prompt into {len(chunks)} forwards "
                         "(compressing the first piece alone would lose what the rest, the question, asks for). "
                         "Leave prefill_chunk_size unset inside `with press(model):`, or give the press a "
                         "`prompt_tail` (what `compress` reads of a prompt's last tokens).")
    return len(chunks) - 1 - index


def _draft_length(kwargs, cache: SparseCache, q: int) -> int:
    """Draft tokens in a first forward: assisted decoding and prompt lookup verify their first draft in the
    prompt's forward and ask for the logits of the prompt's last token and the draft (`logits_to_keep`)."""
    keep = kwargs.get("logits_to_keep")
    if cache.prompt_lengths is not None or not isinstance(keep, int) or not 1 < keep < q:
        return 0
    return keep - 1


def _verifies_draft(kwargs, cache: SparseCache, q: int) -> bool:
    """A forward after the first that verifies a draft: generate's assisted decoding and prompt lookup ask for the
    logits of every one of its tokens (`logits_to_keep` = its length); a continued prompt asks for the last."""
    keep = kwargs.get("logits_to_keep")
    return cache.prompt_lengths is not None and q > 1 and isinstance(keep, int) and keep == q


# Inputs of a forward with one entry per new token, on their last dimension (input_ids, position_ids) or the one
# before (inputs_embeds); the attention mask covers the past too and is left whole.
_PER_TOKEN = {"input_ids": -1, "position_ids": -1, "cache_position": -1, "inputs_embeds": -2}


def _prefill_before_draft(inst: Installation, module, kwargs, draft: int) -> dict:
    """Run the prompt alone first (compressed as in any generation), so the draft is verified against the
    compressed prompt, as tokens decoded one by one would be; the outer forward then runs the draft only. Its
    logits are joined after the prompt's last ones (`_after_model`), so the caller sees one forward."""
    q = kwargs["input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"].shape[1]
    prompt = _tokens(kwargs, 0, q - draft)
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.ndim == 2:
        prompt["attention_mask"] = mask[:, :-draft]
    prompt["logits_to_keep"] = 1
    logits = module(**prompt).logits  # re-enters these hooks: the prompt's forward, compressed
    inst.running.prompt_logits = logits[:, -1:]
    return {**_tokens(kwargs, q - draft, draft), "logits_to_keep": draft}


def _tokens(kwargs: dict, start: int, count: int) -> dict:
    """`kwargs` with its per-token inputs (`_PER_TOKEN`) cut to the new tokens `start:start + count`."""
    return {k: v.narrow(_PER_TOKEN[k], start, count) if k in _PER_TOKEN and torch.is_tensor(v) else v
            for k, v in kwargs.items()}


def _fresh_default(cache) -> bool:
    """The empty `DynamicCache` generate makes when no cache was asked for: a `SparseCache` takes its place."""
    return (type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False)
            and not getattr(cache, "offloading", False) and cache.get_seq_length() == 0)


def _refuse(inst: Installation, cache) -> None:
    """A cache the press cannot compress: a user's own `DynamicCache` runs uncompressed (said once); a static,
    quantized or offloaded one is an error."""
    name = type(inst.press).__name__
    if type(cache) is DynamicCache and not getattr(cache, "offloading", False):
        inst.warn("user_cache", f"sparsekv: {name} cannot compress a DynamicCache it did not build, so this "
                                "generation runs uncompressed; pass no cache, or `press.make_cache(model)`.")
        return
    kind = "offloaded DynamicCache" if getattr(cache, "offloading", False) else type(cache).__name__
    raise ValueError(f"sparsekv: {name} cannot compress a {kind}; inside `with press(model):` leave "
                     "cache_implementation unset and pass no cache (or `press.make_cache(model)`).")


@_without_grad
def _after_model(inst: Installation, module, args, kwargs, output):
    cache, inst.running.cache = getattr(inst.running, "cache", None), None
    if cache is None:
        return None
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, tuple) and output and torch.is_tensor(output[0]):
        logits = output[0]  # return_dict=False
    cache.end_forward(logits)
    prompt_logits, inst.running.prompt_logits = getattr(inst.running, "prompt_logits", None), None
    if prompt_logits is not None and logits is not None:  # a first forward split before its draft
        joined = torch.cat([prompt_logits.to(logits.dtype), logits], dim=1)
        if isinstance(output, tuple):
            return (joined, *output[1:])
        output.logits = joined
    return None


@_without_grad
def _before_attention(module, args, kwargs):
    cache = kwargs.get("cache")
    if not isinstance(cache, SparseCache):
        return None
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    mask = cache.before_layer(module, hidden, kwargs.get("position_embeddings"))
    if mask is KEEP_MASK:
        return None
    kwargs["attention_mask"] = mask
    return args, kwargs


@_without_grad
def _after_queries(inst: Installation, layer_idx: int, module, args, output):
    cache = getattr(inst.running, "cache", None)
    if cache is not None:
        cache.after_queries(layer_idx, output)


@_without_grad
def _after_attention(module, args, kwargs, output):
    cache = kwargs.get("cache")
    if isinstance(cache, SparseCache):
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        cache.after_layer(module.layer_idx, weights)
