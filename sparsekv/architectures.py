"""Which models sparsekv serves, checked when a press is installed.

sparsekv hooks the `self_attn` module of each decoder layer (transformers' Llama-style decoders), rebuilds the
queries it needs from the module's query projection (`q_proj`, or a fused `qkv_proj` with the queries first,
normed by `q_norm` per head or over the whole projection) rotated by the rotary position embeddings the model
hands the module (`position_embeddings`), and gives the model a cache whose full-attention layers the press
compresses (the other layer types keep transformers' own). A model that lacks one of these is refused at
`with press(model):`, before anything runs, with the architecture's name, the reason and what to use instead
(`check_model`); every architecture transformers ships is walked by the tests (tests/test_architectures.py).
"""

from __future__ import annotations

import inspect
import typing

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

from .attention import query_norm

# Layer types sparsekv compresses; the others (e.g. Gemma3's sliding layers) keep transformers' own layer.
COMPRESSED_LAYER_TYPES = ("full_attention",)
SUPPORTED_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
# Projections of multi-head latent attention (DeepSeek-V2/V3 and their kin): keys and queries with a rotary and a
# non-rotary part, not one `q_proj` rotated whole.
_LATENT = ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj")
_INSTEAD = ("use a model whose decoder layers sparsekv serves (Llama, Mistral, Qwen2/3, Gemma, Phi-3, OLMo, "
            "SmolLM, Granite ...: README, 'What works')")


# Attention classes whose queries sparsekv rebuilds as the module computes them: the classes of the architectures
# that tests/test_architectures.py finds working (it fails when one is missing here, or listed and not working).
VERIFIED = frozenset({
    "Apertus1p5TextAttention", "ApertusAttention", "ArceeAttention", "AriaTextAttention", "BitNetAttention",
    "CwmAttention", "DiffLlamaAttention", "DogeAttention", "Dots1Attention", "FlexOlmoAttention", "Gemma2Attention",
    "Gemma3Attention", "GemmaAttention", "Glm4MoeAttention", "GraniteAttention", "GraniteMoeAttention",
    "GraniteMoeSWAAttention", "GraniteMoeSharedAttention", "GraniteSWAAttention", "HYV3Attention",
    "HyperCLOVAXAttention", "Jais2Attention", "LagunaAttention", "LaraMiniAttention", "Lfm2Attention",
    "Lfm3Attention", "LlamaAttention", "MellumAttention", "MiMoV2FlashAttention", "MiniMaxM2Attention",
    "MiniMaxM3VLAttention", "Ministral3Attention", "MistralAttention", "MixtralAttention", "NemotronAttention",
    "Olmo2Attention", "Olmo3Attention", "OlmoAttention", "OlmoHybridAttention", "OlmoeAttention", "Phi3Attention",
    "PhiAttention", "PhimoeAttention", "Qwen2Attention", "Qwen2MoeAttention", "Qwen3Attention", "Qwen3MoeAttention",
    "SeedOssAttention", "SmolLM3Attention", "SolarOpenAttention", "StableLmAttention", "Starcoder2Attention",
    "VaultGemmaAttention",
})
# What sets apart the attention of the architectures whose queries sparsekv does not rebuild (the tests find them).
_INTERLEAVED = "rotates its queries in interleaved pairs of channels, where sparsekv rotates Llama's two halves"
_GLOBAL_NOPE = "leaves the queries of its full-attention layers unrotated while its sliding layers rotate theirs"
DIFFERS: dict[str, str] = {
    "AfmoeAttention": _GLOBAL_NOPE, "FlintAttention": _GLOBAL_NOPE, "Exaone4Attention": _GLOBAL_NOPE,
    "ExaoneMoeAttention": _GLOBAL_NOPE, "Kolibri1Attention": _GLOBAL_NOPE,
    "CohereAttention": _INTERLEAVED, "Cohere2Attention": _INTERLEAVED, "Cohere2MoeAttention": _INTERLEAVED,
    "Ernie4_5Attention": _INTERLEAVED, "Ernie4_5_MoeAttention": _INTERLEAVED, "HeliumAttention": _INTERLEAVED,
    "GlmAttention": _INTERLEAVED, "Glm4Attention": _INTERLEAVED,
    "GptOssAttention": "adds learned attention sinks to its softmax, which sparsekv's rebuilt attention lacks",
    "HunYuanDenseV1Attention": "normalises its queries after RoPE (`query_layernorm`), where sparsekv norms before",
    "HunYuanMoEV1Attention": "normalises its queries after RoPE (`query_layernorm`), where sparsekv norms before",
    "NanoChatAttention": "normalises its queries after RoPE, where sparsekv norms before",
    "DoryAttention": "rescales its queries per channel after RoPE (nGPT's `sqk`), which sparsekv does not rebuild",
    "Qwen3NextAttention": "projects an output gate with its queries (`q_proj` gives both), which sparsekv does not "
                          "take apart",
    "Qwen3_5Attention": "projects an output gate with its queries (`q_proj` gives both), which sparsekv does not "
                        "take apart",
    "Qwen3_5MoeAttention": "projects an output gate with its queries (`q_proj` gives both), which sparsekv does "
                           "not take apart",
}


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The decoder's self-attention modules by layer index (transformers names them `...self_attn`)."""
    found = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] == "self_attn" and isinstance(getattr(module, "layer_idx", None), int):
            found.setdefault(module.layer_idx, module)
    return found


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that makes the model's logits (`lm_head`), None when the model has none."""
    getter = getattr(model, "get_output_embeddings", None)
    return getter() if getter is not None else None


def head_logits(model: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
    """The model's logits from its output head's `output`: capped as the model caps them after the head (Gemma 2
    and 3's `final_logit_softcapping`)."""
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    return output if cap is None else torch.tanh(output / cap) * cap


def compressed_layers(config) -> list[int]:
    """Indices of the layers a press compresses: the full-attention ones."""
    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return [i for i, t in enumerate(types) if t in COMPRESSED_LAYER_TYPES]


def rotary(module: torch.nn.Module) -> bool:
    """Whether the attention module rotates its queries and keys with the position embeddings it is given: False
    for the layers of a model that leaves some without position embeddings (`use_rope`, SmolLM3's NoPE layers)."""
    return bool(getattr(module, "use_rope", True))


def check_model(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules a press compresses on `model`, or a ValueError naming the architecture, why sparsekv
    cannot serve it, and what to do instead."""
    arch = type(model).__name__

    def refuse(reason: str, instead: str = _INSTEAD) -> ValueError:
        return ValueError(f"model: sparsekv cannot serve {arch}: {reason}; {instead}.")

    indexed = [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, "layer_idx", None), int)]
    if not indexed:
        raise refuse("it has no attention layers with a KV cache (looked for decoder layers' `self_attn` modules "
                     "with a `layer_idx`: a recurrent or state-space model keeps a state, not keys and values)")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"attn_implementation: {impl!r} is not supported; use one of {SUPPORTED_ATTENTION}.")
    modules = attention_modules(model)
    if not modules:
        attention = [(n, m) for n, m in indexed if "attention" in type(m).__name__.lower()]
        if not attention:
            raise refuse(f"it has no attention layers with a KV cache (its layers, {type(indexed[0][1]).__name__}, "
                         "keep a recurrent or state-space state, not keys and values)")
        name, module = attention[0]
        raise refuse(f"its attention modules (`{name}`, {type(module).__name__}) are not decoder layers' `self_attn` "
                     "modules, the ones sparsekv hooks")
    shared = sorted({m.layer_idx for name, m in indexed
                     if name.endswith("self_attn") and m is not modules[m.layer_idx]})
    if shared:
        raise refuse(f"several attention modules share layer index {shared[0]} (one cache layer for each), so what "
                     "a press keeps for one would be read by the other")
    text = model.config.get_text_config(decoder=True)
    if any(mode == "reuse" for mode in getattr(text, "kv_sharing_modes", None) or ()):
        raise refuse("some of its layers read the keys and values of other layers (KV sharing), which would read "
                     "another layer's compressed cache with their own positions")
    try:
        types, _ = get_layer_types_and_kwargs(text)
    except Exception as err:  # a config transformers' cache cannot lay out either
        raise refuse(f"its layer types cannot be read from its config ({err})") from None
    unknown = sorted({t for t in types if t not in COMPRESSED_LAYER_TYPES and t not in DYNAMIC_LAYER_TYPE_MAPPING})
    if unknown:
        raise refuse(f"its {', '.join(unknown)} layers keep a state that transformers' dynamic cache, which "
                     "sparsekv's extends, does not hold")
    own = _own_cache(model)
    if own:
        raise refuse(f"it builds a cache of its own ({own}) and refuses any other")
    targets = [modules[i] for i, t in enumerate(types) if t in COMPRESSED_LAYER_TYPES and i in modules]
    if not targets:
        raise refuse("it has no full-attention layers to compress (all are sliding-window or linear; a sliding "
                     "window already bounds their cache)", "nothing to do: its cache does not grow with the prompt "
                     "past the window")
    for module in {type(m): m for m in targets}.values():
        name = type(module).__name__
        reason = _attention_mismatch(module, model.config)
        if reason is None and not verified(type(module)):
            reason = DIFFERS.get(name, "is not one whose queries sparsekv is verified to rebuild as the module "
                                       "computes them (tests/test_architectures.py walks transformers' models)")
        if reason:
            raise refuse(f"its attention ({name}) {reason}")
    return targets


def verified(cls: type) -> bool:
    """Whether the attention class is one the tests verified, or a subclass that keeps its `forward`."""
    return any(base.__name__ in VERIFIED and cls.forward is base.forward for base in cls.__mro__)


def _attention_mismatch(module: torch.nn.Module, config) -> str | None:
    """Why sparsekv cannot rebuild this attention module's queries, or None when it can."""
    if any(hasattr(module, name) for name in _LATENT):
        return ("is multi-head latent attention (DeepSeek-V2/V3 style: its queries and keys have a rotary and a "
                "non-rotary part), whose queries sparsekv does not rebuild")
    if "position_embeddings" not in inspect.signature(module.forward).parameters:
        return ("gets no rotary position embeddings (it adds learned positions to its inputs, or biases attention "
                "by distance), and sparsekv rebuilds queries with the model's RoPE")
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or not isinstance(getattr(module, "scaling", None), (int, float)):
        return "does not say its head size and scaling (`head_dim`, `scaling`), which sparsekv reads"
    projection = getattr(module, "q_proj", None) or getattr(module, "qkv_proj", None)
    if not isinstance(projection, torch.nn.Module):
        return ("has no query projection of its own (`q_proj`, or `qkv_proj` with the queries first): its queries "
                "are fused with keys and values, which sparsekv does not take apart")
    if getattr(module, "attn_temperature_tuning", False):
        return ("scales the queries of its layers without RoPE with their position past `floor_scale` tokens "
                "(attention temperature tuning), which sparsekv does not rebuild")
    width = getattr(query_norm(module), "weight", None)
    heads = getattr(config.get_text_config(decoder=True), "num_attention_heads", None)
    if width is not None and width.shape[-1] not in (head_dim, heads * head_dim if heads else -1):
        return ("normalises its queries (`q_norm`) over neither a head nor the whole projection, which sparsekv "
                "does not rebuild")
    return None


def _own_cache(model: torch.nn.Module) -> str | None:
    """The cache class the model's decoder insists on, when its `cache` argument names one other than
    transformers' `Cache` (MiniMax's); None for every model that takes any cache."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None:
        return None
    parameter = inspect.signature(decoder.forward).parameters.get("cache")
    if parameter is None or parameter.annotation is inspect.Parameter.empty:
        return None
    annotation = parameter.annotation
    if isinstance(annotation, str):
        names = {part.strip() for part in annotation.replace("Optional[", "").replace("]", "").split("|")}
    else:
        names = {getattr(a, "__name__", str(a)) for a in (typing.get_args(annotation) or (annotation,))}
    names -= {"Cache", "None", "NoneType"}
    return ", ".join(sorted(names)) or None
