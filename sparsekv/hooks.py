"""Installing a press on a model: forward hooks that hand each event of a forward to its cache, no patching.

The hooks hold no state of a generation: they find the generation's `SparseCache` in the forward's arguments
and call its driver (`SparseCache.begin_forward`, `before_layer`, `after_queries`, `after_layer`, `after_head`,
`end_forward`). The query projection's and the output head's hooks see no cache argument; they read the cache of
the forward running in their own thread (a thread-local of the installation), so concurrent generations on one
model never meet.
"""

from __future__ import annotations

import functools
import threading
import weakref
from contextlib import contextmanager
from functools import partial

import torch
from transformers import StaticCache

from .architectures import check_model, head_logits, output_head
from .attention import query_projection, sparsekv_implementation
from .cache import KEEP_MASK, SparseCache
from .generation import (
    compile_in_block, draft_length, eager_notice, fresh_default, pieces_after, prefill_before_draft,
    prefill_locals, prompt_columns, refuse_cache, static_length, verifies_draft,
)
from .log import logger
from .probe import ProbeCache

_active: weakref.WeakSet = weakref.WeakSet()  # models with a press installed: presses do not nest


def installed(model: torch.nn.Module) -> bool:
    """Whether a press is installed on `model` now (inside `with press(model):`)."""
    return model in _active


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
    if model in _active:  # (first: inside a block, the model's attention is sparsekv's, which `check_model` refuses)
        raise ValueError("model: a sparsekv press is already installed on this model; presses do not nest.")
    targets = check_model(model)
    inst, handles = Installation(press, model), []
    restore = compile_in_block(press, model) if press.compile else None
    _active.add(model)
    own = model.config._attn_implementation
    try:
        # For the block, the model's implementation runs inside sparsekv's, which reads a layer's lanes (heads
        # of different lengths) and keeps a step's attention weights for a press that reads them, not computed
        # again (`sparsekv_implementation`).
        wrapped = sparsekv_implementation(own)
        if wrapped is not None:
            model.set_attn_implementation(wrapped)
        weighing = wrapped is not None and press.reads_step_attention
        handles.append(model.register_forward_pre_hook(partial(_before_model, inst), with_kwargs=True))
        handles.append(model.register_forward_hook(partial(_after_model, inst), with_kwargs=True))
        head = output_head(model) if press.reads_logits else None
        if head is not None:  # inside the model's forward: a compiled step's graph holds the press's end_forward
            handles.append(head.register_forward_hook(partial(_after_head, inst)))
        before = partial(_before_attention, weighing, wrapped is not None)
        for module in targets:
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(_after_attention, with_kwargs=True))
            projection = query_projection(module) if press.captures_step_queries else None
            if projection is not None:  # a hook makes every call of the projection slower: only where it is read
                handles.append(projection.register_forward_hook(partial(_after_queries, inst, module.layer_idx)))
        yield model
    finally:
        for handle in handles:
            handle.remove()
        _active.discard(model)
        if model.config._attn_implementation != own:
            model.set_attn_implementation(own)
        if restore is not None:
            restore()


# Host work only, never traced: generate compiles `model.__call__`, whose hooks dynamo would trace as a frame of
# their own, with guards over the cache of their own to check at every step (beside the model's frame).
@torch.compiler.disable
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
    inputs = kwargs.get("input_ids", args[0] if args else None)
    shape = (inputs if inputs is not None else kwargs["inputs_embeds"]).shape
    if inst.press.compile and fresh_default(cache, StaticCache):  # (for `compile`: its length is the generation's)
        cache = kwargs[key] = SparseCache(inst.press, inst.model.config, compiled=True,
                                          max_new_tokens=max(static_length(cache) - shape[1], 1))
        kwargs["attention_mask"] = prompt_columns(kwargs.get("attention_mask"), shape[1])
    elif cache is None or fresh_default(cache):
        default, cache = cache, SparseCache(inst.press, inst.model.config)
        if default is not None and any(getattr(layer, "record_past", False) for layer in default.layers):
            cache.activate_past_recording()  # generate asked its cache to be croppable (drafts)
        kwargs[key] = cache
    elif not isinstance(cache, SparseCache):
        refuse_cache(inst, cache)
        return None
    elif cache.press is not inst.press and cache.press != inst.press:  # (an equal press may continue it)
        raise ValueError(f"cache: it was built under {cache.press!r}, and this block installs {inst.press!r}; a "
                         "cache holds its press's selection and state, so continue it under the press that built it "
                         "(or start a new cache: pass none, or `press.make_cache(model)`).")
    if kwargs.get("output_attentions"):
        inst.warn("output_attentions", f"sparsekv: output_attentions under {type(inst.press).__name__}: a compressed "
                                       "layer's weights are over the slots its cache holds, in slot order "
                                       "(`cache.layers[i].positions` gives each slot's position), not over every "
                                       "position.")
    draft = 0 if args else draft_length(kwargs, cache, shape[1])  # generate passes keywords only
    if draft:
        kwargs = prefill_before_draft(inst, module, kwargs, draft)
        inputs, shape = kwargs.get("input_ids"), (shape[0], draft)
    verifies = bool(draft) or verifies_draft(kwargs, cache, shape[1])
    pieces = 0
    if cache.prompt_lengths is None or cache.pieces is not None:  # a prompt: generate's prefill runs it
        prefill = prefill_locals()
        pieces = pieces_after(inst.press, prefill) if shape[1] > 1 else 0
        notice = eager_notice(inst.press, prefill, cache)
        if notice is not None:
            inst.warn("eager", notice)
    cache.begin_forward(inputs, kwargs.get("attention_mask"), shape[1], shape[0], draft=verifies,
                        pieces_left=pieces)
    inst.running.cache = cache
    return args, kwargs


@torch.compiler.disable  # host work only: a frame of its own would be guarded at every compiled step
@_without_grad
def _after_model(inst: Installation, module, args, kwargs, output):
    cache, inst.running.cache = getattr(inst.running, "cache", None), None
    if cache is None:
        return None
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, tuple) and output and torch.is_tensor(output[0]):
        logits = output[0]  # return_dict=False
    cache.end_forward(logits, inst.model)
    prompt_logits, inst.running.prompt_logits = getattr(inst.running, "prompt_logits", None), None
    if prompt_logits is not None and logits is not None:  # a first forward split before its draft
        joined = torch.cat([prompt_logits.to(logits.dtype), logits], dim=1)
        if isinstance(output, tuple):
            return (joined, *output[1:])
        output.logits = joined
    return None


@_without_grad
def _before_attention(weighing: bool, reads_lanes: bool, module, args, kwargs):
    cache = kwargs.get("cache")
    if not isinstance(cache, SparseCache):
        if isinstance(cache, ProbeCache):  # a press's own forward (`Press.after_prompt`)
            cache.before(module, kwargs.get("hidden_states", args[0] if args else None),
                         kwargs.get("position_embeddings"))
        return None
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    mask = cache.before_layer(module, hidden, kwargs.get("position_embeddings"))
    keep = weighing and cache.keeps_weights()  # (`weighing`: the attention can keep them, `install`)
    lanes = getattr(cache.layers[module.layer_idx], "lanes", None)
    if mask is KEEP_MASK and not keep and lanes is None:
        return None
    if mask is not KEEP_MASK:
        kwargs["attention_mask"] = mask
    if lanes is not None:  # (to `sparsekv_implementation`'s attention, which reads them)
        if not reads_lanes:  # (`install`: the model's attention is not sparsekv's, which reads them)
            raise ValueError(f"sparsekv: layer {module.layer_idx} holds its heads' tokens in lanes (head-wise "
                             "budgets), which sparsekv's attention reads over sdpa or eager attention; continue this "
                             "cache on a model loaded with attn_implementation=\"sdpa\" (or \"eager\").")
        kwargs["lanes"] = lanes
    if keep:
        kwargs["keep_weights"] = True  # (to `sparsekv_implementation`'s, through the module's keywords)
    return args, kwargs


@_without_grad
def _after_head(inst: Installation, module, args, output):
    cache = getattr(inst.running, "cache", None)
    if cache is not None and torch.is_tensor(output):
        cache.after_head(head_logits(inst.model, output))


@_without_grad
def _after_queries(inst: Installation, layer_idx: int, module, args, output):
    cache = getattr(inst.running, "cache", None)
    if cache is not None:
        cache.after_queries(layer_idx, output)


@_without_grad
def _after_attention(module, args, kwargs, output):
    cache = kwargs.get("cache")
    if isinstance(cache, SparseCache):
        cache.after_layer(module.layer_idx, output[1] if kwargs.get("keep_weights") else None)
    elif isinstance(cache, ProbeCache):
        cache.after(module)
