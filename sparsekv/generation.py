"""What sparsekv reads of transformers' `generate`: which forward is a draft being verified (assisted decoding,
prompt lookup), which is a piece of a prompt read in pieces (`prefill_chunk_size`), which cache `generate`
made by default, and whether it was asked to compile, so that the hooks treat each forward as `generate` meant
it."""

from __future__ import annotations

import copy
import sys
from typing import Callable

import torch
from transformers import CompileConfig, DynamicCache

from .cache import SparseCache

# The presses whose decoding steps compile.
COMPILING = ("StreamingLLM's, H2O's, SnapKV's, PyramidKV's, ChunkKV's, CHESS's, SentenceKV's, Knorm's, KeyDiff's, "
             "TOVA's and ExpectedAttention's, alone or under AdaKV, and KVzip's")


def prefill_locals() -> dict:
    """The locals of generate's own prefill (`GenerationMixin._prefill`, a frame up the stack) running this prompt
    forward, or {} when none runs it (a forward called directly; assisted decoding prefills without it).

    A forward is told neither that it is a piece of a prompt read in pieces (`prefill_chunk_size`) nor which
    `compile_config` generate was given: no argument, and nothing public in transformers, says so. This is read
    once per prompt forward, never at a decoding step. (The generate mode tests compare a prompt in pieces with one
    forward for every press: a transformers that names these otherwise fails them.)
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_prefill":
        frame = frame.f_back
    return {} if frame is None else frame.f_locals


def eager_notice(press, prefill: dict, cache: SparseCache) -> str | None:
    """What to say when generate was given a `compile_config` (in its prefill's locals, `prefill`) and will decode
    this cache eagerly: transformers skips compiling with a notice that does not say why. None otherwise."""
    if getattr(prefill.get("generation_config"), "compile_config", None) is None or cache.compiled:
        return None
    name = type(press).__name__
    if not press.compiled_decoding:
        return (f"sparsekv: generate was given a compile_config and decodes eagerly: {name}'s decoding steps do not "
                f"compile yet ({COMPILING} do).")
    return (f"sparsekv: generate was given a compile_config and decodes eagerly: under a press it compiles when the "
            f"press says so, `{name}(..., compile=True)` (or over a cache made for it, "
            "`press.make_cache(model, compiled=True, max_new_tokens=...)`).")


def pieces_after(press, prefill: dict) -> int:
    """When this forward is a piece of a prompt that generate reads in several (`prefill_chunk_size`), how many
    pieces follow it, from the locals of generate's prefill (`prefill_locals`); else 0. A press that cannot
    compress such a prompt refuses it (`Press.prompt_tail`), rather than compress its first piece alone, before
    the rest (the question) is read."""
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


def draft_length(kwargs, cache: SparseCache, q: int) -> int:
    """Draft tokens in a first forward: assisted decoding and prompt lookup verify their first draft in the
    prompt's forward and ask for the logits of the prompt's last token and the draft (`logits_to_keep`)."""
    keep = kwargs.get("logits_to_keep")
    if cache.prompt_lengths is not None or not isinstance(keep, int) or not 1 < keep < q:
        return 0
    return keep - 1


def verifies_draft(kwargs, cache: SparseCache, q: int) -> bool:
    """A forward after the first that verifies a draft: generate's assisted decoding and prompt lookup ask for the
    logits of every one of its tokens (`logits_to_keep` = its length); a continued prompt asks for the last."""
    keep = kwargs.get("logits_to_keep")
    return cache.prompt_lengths is not None and q > 1 and isinstance(keep, int) and keep == q


# Inputs of a forward with one entry per new token, on their last dimension (input_ids, position_ids) or the one
# before (inputs_embeds); the attention mask covers the past too and is left whole.
PER_TOKEN = {"input_ids": -1, "position_ids": -1, "cache_position": -1, "inputs_embeds": -2}


def prefill_before_draft(inst, module, kwargs, draft: int) -> dict:
    """Run the prompt alone first (compressed as in any generation), so the draft is verified against the
    compressed prompt, as tokens decoded one by one would be; the outer forward then runs the draft only. Its
    logits are joined after the prompt's last ones (`_after_model`), so the caller sees one forward."""
    q = kwargs["input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"].shape[1]
    prompt = new_tokens(kwargs, 0, q - draft)
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.ndim == 2:
        prompt["attention_mask"] = mask[:, :-draft]
    prompt["logits_to_keep"] = 1
    logits = module(**prompt).logits  # re-enters these hooks: the prompt's forward, compressed
    inst.running.prompt_logits = logits[:, -1:]
    return {**new_tokens(kwargs, q - draft, draft), "logits_to_keep": draft}


def new_tokens(kwargs: dict, start: int, count: int) -> dict:
    """`kwargs` with its per-token inputs (`PER_TOKEN`) cut to the new tokens `start:start + count`."""
    return {k: v.narrow(PER_TOKEN[k], start, count) if k in PER_TOKEN and torch.is_tensor(v) else v
            for k, v in kwargs.items()}


def fresh_default(cache, kind: type = DynamicCache) -> bool:
    """The empty cache of type `kind` generate makes when no cache was asked for, which a `SparseCache` takes the
    place of: a `DynamicCache`, or in a block whose press compiles a `StaticCache` (`compile_in_block`), whose
    length, the prompt's and `max_new_tokens`, gives the compiled cache's room."""
    return (type(cache) is kind and not getattr(cache, "_is_user_defined", False)
            and not getattr(cache, "offloading", False) and cache.get_seq_length() == 0)


def static_length(cache) -> int:
    """The tokens a `StaticCache` holds, prompt and new ones: its longest layer's."""
    return max(layer.max_cache_len for layer in cache.layers)


def prompt_columns(mask, q: int):
    """A prompt's 4D masks `(batch, 1, q, kv)` that generate built for its static cache (`fresh_default`), whose
    keys are the cache's every slot: cut to the prompt's `q` keys, the keys of the cache that replaces it. A 2D
    mask (or none) as it is."""
    if isinstance(mask, dict):
        return {kind: prompt_columns(m, q) for kind, m in mask.items()}
    return mask[..., :q] if isinstance(mask, torch.Tensor) and mask.ndim == 4 else mask


# Inductor's options for a press's compiled decoding steps. `reorder_for_locality` (on in inductor's defaults) moves
# each layer's attention output down to where the next layer reads it, past the core's eviction that overwrites the
# slot of a value it still reads: inductor keeps the read by copying the layer's values into a new buffer and back,
# whole, at every layer of every step (torch 2.13; 0.4 ms of a compiled TOVA step on a 2-core CPU, 2% of it).
STEP_OPTIONS = {"reorder_for_locality": False}


def compile_config(base: CompileConfig | None = None) -> CompileConfig:
    """The `compile_config` for a press's compiled decoding steps: `base` (default: transformers' own, told to
    compile on a CPU too) with sparsekv's inductor options (`STEP_OPTIONS`; the base's own win), its `mode` given
    as the options it stands for (torch.compile takes one or the other). What a press made with `compile=True`
    compiles with, unless the model's generation config or generate is given one: give generate
    `compile_config(yours)` to keep your settings and sparsekv's. A backend other than inductor: `base` as it is."""
    config = copy.deepcopy(base) if base is not None else CompileConfig()
    if base is None:
        config._compile_all_devices = True  # (its switch: on a CPU, transformers compiles only so)
    if config.backend != "inductor":
        return config
    modes = torch._inductor.list_mode_options(config.mode) if config.mode else {}
    config.mode, config.options = None, {**modes, **STEP_OPTIONS, **(config.options or {})}
    return config


def compile_in_block(press, model) -> Callable[[], None]:
    """A press's `compile`: inside its `with` block, generate makes a static cache (which a compiled `SparseCache`
    replaces at the prompt, `fresh_default`) and so compiles its decoding steps, as it does for a static cache,
    with `compile_config` of the model's own, or of transformers' default. transformers decides whether to compile
    from the cache it made before the first forward, so the model's generation config says so for the block
    (restored on exit), not the cache. Returns what restores it."""
    config = model.generation_config
    if config.cache_implementation not in (None, "static"):
        raise ValueError(f"{type(press).__name__}: compile=True, but the model's generation_config asks for "
                         f"cache_implementation={config.cache_implementation!r}; unset it inside the block.")
    press.make_cache(model, compiled=True, max_new_tokens=1)  # (refuses, here, a model whose steps cannot compile)
    before = config.cache_implementation, config.compile_config
    config.cache_implementation = "static"
    config.compile_config = compile_config(config.compile_config)  # (the model's own, with sparsekv's options)

    def restore() -> None:
        config.cache_implementation, config.compile_config = before
    return restore


def refuse_cache(inst, cache) -> None:
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
