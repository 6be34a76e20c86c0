"""Installing a press on a model: forward hooks, no patching.

- A pre-hook on the model gives every forward that would create a default cache a `SparseCache` instead, and
  tells the cache which input tokens are real. A hook after the model hands the logits to the press.
- Hooks on each full-attention module: before attention, the press may prepare the layer (selection) and the
  mask is rebuilt for the layer's physical layout once it is compressed; after attention, the press compresses
  the prompt (first forward) or does its per-step work (every later forward).
- A hook after each such module's query projection: on forwards after the prompt, presses that read queries
  get the projection as it was computed (`AttentionCall.projected`), so a step's queries are never projected
  twice; `on_queries` runs there, before attention.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from .attention import AttentionCall, query_projection
from .cache import COMPRESSED_LAYER_TYPES, SparseCache

SUPPORTED_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
_active: weakref.WeakSet = weakref.WeakSet()  # models with a press installed: presses do not nest


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The decoder's self-attention modules by layer index (transformers names them `...self_attn`)."""
    found = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] == "self_attn" and isinstance(getattr(module, "layer_idx", None), int):
            found.setdefault(module.layer_idx, module)
    return found


def compressed_layers(config) -> list[int]:
    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return [i for i, t in enumerate(types) if t in COMPRESSED_LAYER_TYPES]


@contextmanager
def install(press, model: torch.nn.Module):
    """Context manager behind `press(model)`: every hook is removed on exit, also on an exception."""
    modules = attention_modules(model)
    if not modules:
        raise ValueError(
            f"model: no attention modules found in {type(model).__name__} (looked for decoder layers' "
            "`self_attn` modules with a `layer_idx`); sparsekv supports transformers decoder-only models."
        )
    impl = model.config._attn_implementation
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"attn_implementation: {impl!r} is not supported; use one of {SUPPORTED_ATTENTION}.")
    if model in _active:
        raise ValueError("model: a sparsekv press is already installed on this model; presses do not nest.")
    targets = [modules[i] for i in compressed_layers(model.config) if i in modules]
    if not targets:
        raise ValueError("model: it has no full-attention layers to compress (all are sliding-window or linear).")
    handles = []
    steps: dict[int, tuple] = {}  # layer -> (cache, call) of this forward, from before attention to after it
    _active.add(model)
    try:
        handles.append(model.register_forward_pre_hook(partial(_before_model, press, model), with_kwargs=True))
        handles.append(model.register_forward_hook(_after_model, with_kwargs=True))
        for module in targets:
            handles.append(module.register_forward_pre_hook(partial(_before_attention, steps), with_kwargs=True))
            handles.append(module.register_forward_hook(partial(_after_attention, steps), with_kwargs=True))
            projection = query_projection(module)
            if projection is not None:
                handles.append(projection.register_forward_hook(partial(_after_queries, steps, module)))
        yield model
    finally:
        for handle in handles:
            handle.remove()
        steps.clear()
        _active.discard(model)


def _before_model(press, model, module, args, kwargs):
    use_cache = kwargs.get("use_cache")
    if use_cache is False or (use_cache is None and not getattr(model.config, "use_cache", True)):
        return None
    # transformers >= 5.24 calls it `cache`; a caller's deprecated `past_key_values` is still renamed by forward.
    key = "past_key_values" if "past_key_values" in kwargs and "cache" not in kwargs else "cache"
    cache = kwargs.get(key)
    fresh_default = (
        type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False) and cache.get_seq_length() == 0
    )
    if cache is None or fresh_default:
        cache = kwargs[key] = SparseCache(press, model.config)
    if isinstance(cache, SparseCache):
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None:
            inputs = kwargs["inputs_embeds"]
        cache.begin_forward(kwargs.get("attention_mask"), inputs.shape[1], inputs.shape[0])
        if cache.press.reads_input_ids:
            cache.press.before_forward(cache, kwargs.get("input_ids", args[0] if args else None))
    return args, kwargs


@torch.no_grad()
def _after_model(module, args, kwargs, output):
    cache = getattr(output, "cache", None)
    logits = getattr(output, "logits", None)
    if isinstance(cache, SparseCache) and logits is not None:
        cache.press.on_logits(cache, logits)


def _cache_of(kwargs) -> SparseCache | None:
    cache = kwargs.get("cache")
    return cache if isinstance(cache, SparseCache) else None


def _call(module, args, kwargs, cache, weights=None) -> AttentionCall:
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    return AttentionCall(module, hidden, kwargs["position_embeddings"], weights, cache.input_valid)


@torch.no_grad()  # press work never needs gradients
def _before_attention(steps, module, args, kwargs):
    steps.pop(module.layer_idx, None)
    cache = _cache_of(kwargs)
    if cache is None:
        return None
    layer = cache.layers[module.layer_idx]
    capture = cache.press.reads_step_queries and layer.logical_len > 0  # after the prompt: capture the queries
    if cache.press.selects_before_attention or capture:  # skip building the call otherwise
        call = _call(module, args, kwargs, cache)
        press_before_attention(cache, layer, call)
        if capture:
            steps[module.layer_idx] = cache, call
    if not layer.compressed:
        return None
    impl = module.config._attn_implementation
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if cache.input_valid is None and layer.all_valid and (hidden.shape[1] == 1 or impl.startswith("flash")):
        kwargs["attention_mask"] = None  # every slot real, nothing causal to mask: the fast path
    else:
        new_valid = cache.input_valid
        if new_valid is None:
            new_valid = torch.ones(hidden.shape[:2], dtype=torch.bool, device=layer.valid.device)
        kwargs["attention_mask"] = physical_mask(layer.valid, new_valid, impl, hidden.dtype)
    return args, kwargs


@torch.no_grad()
def _after_queries(steps, attention, module, args, output):
    cache, call = steps.get(attention.layer_idx, (None, None))
    if call is None or call.projected is not None:  # the prompt, no press reading queries, or a press's own
        return  # projection (run from `on_queries`)
    call.projected = output
    cache.press.on_queries(cache, cache.layers[attention.layer_idx], call)


@torch.no_grad()
def _after_attention(steps, module, args, kwargs, output):
    _, call = steps.pop(module.layer_idx, (None, None))
    cache = _cache_of(kwargs)
    if cache is None:
        return
    weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
    if call is None:
        call = _call(module, args, kwargs, cache)
    call.weights = weights
    press_after_attention(cache, cache.layers[module.layer_idx], call)


def press_before_attention(cache: SparseCache, layer, call: AttentionCall) -> None:
    """The press's work before a layer's attention (selection presses only)."""
    if cache.press.selects_before_attention:
        cache.press.before_attention(cache, layer, call)


def press_after_attention(cache: SparseCache, layer, call: AttentionCall) -> None:
    """The press's work after a layer's attention: compress the prompt, or its per-step work, timed."""
    start = time.perf_counter()
    if layer.logical_len == call.q_len:  # first forward of this cache: the prompt
        cache.press.compress(cache, layer, call)
        cache.seconds["compress"] += time.perf_counter() - start
    else:
        cache.press.after_step(cache, layer, call)
        cache.seconds["step"] += time.perf_counter() - start


def physical_mask(past_valid: torch.Tensor, new_valid: torch.Tensor, impl: str, dtype: torch.dtype):
    """The attention mask of a compressed layer: past slots by validity, new tokens causal among themselves.

    Returns what the attention implementation expects: None when nothing is masked; a 2D `(batch, kv)` mask for
    flash attention (it aligns causality bottom-right, which matches new tokens appended last); a 4D boolean
    mask for sdpa; a 4D additive float mask for eager.
    """
    q = new_valid.shape[1]
    kv_valid = torch.cat([past_valid, new_valid.to(past_valid.device)], dim=-1)
    if impl.startswith("flash"):
        return None if bool(kv_valid.all()) else kv_valid
    if q == 1 and bool(kv_valid.all()):
        return None
    n = past_valid.shape[1]
    mask = kv_valid[:, None, None, :].repeat(1, 1, q, 1)
    mask[..., n:] &= torch.ones(q, q, dtype=torch.bool, device=mask.device).tril()
    if impl == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask
