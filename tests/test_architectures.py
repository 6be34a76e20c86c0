"""Every decoder-only causal LM architecture the installed transformers ships, built tiny from its config class:
each works under every press, or `with press(model):` refuses it at entry, naming the architecture and why.

Works means: at `ratio=1.0` every press generates what the model does without one, token for token; at
`ratio=0.25` every press runs and holds its budget; and the attention sparsekv rebuilds from a layer's inputs
(its queries, normed and rotated as the module does) is the module's own, to float32 precision (the weights
eager attention returns). The README's list of architectures that work comes from here
(`test_the_readme_lists_the_architectures_that_work`; `python tests/test_architectures.py` prints it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import pathlib
import re
import sys
import warnings

import pytest
import torch
import transformers
from conftest import make_tokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from sparsekv import (
    CHESSPress,
    ChunkPress,
    H2OPress,
    Press,
    SentencePress,
    SnapKVPress,
    StreamingLLMPress,
    architectures,
)

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# The sizes of every tiny model, where its config has the field.
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, moe_intermediate_size=32,
             num_experts=4, n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
             shared_expert_intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Multi-head latent attention's own head sizes (DeepSeek-V2/V3 and kin), in place of `head_dim`.
LATENT = dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16)
# Architectures whose causal LM cannot be built tiny from its config class alone, and why (each is checked to
# fail to build, so that one transformers makes buildable joins the walk).
NOT_BUILT = {
    "blt": "byte-level patches: sub-models with sizes of their own", "fuyu": "multimodal (an image encoder)",
    "gemma3": "multimodal (a vision tower)", "gemma3n": "multimodal (needs timm)",
    "gemma4": "multimodal (a vision tower)", "gemma4_unified": "multimodal (a vision tower)",
    "gemma4_unified_assistant": "an assistant with a vision tower", "git": "multimodal (a vision tower)",
    "got_ocr2": "multimodal (a vision tower)", "mllama": "multimodal (a vision tower)",
    "moss_transcribe_diarize": "multimodal (an audio encoder)", "phi4_multimodal": "multimodal (vision and audio)",
    "dbrx": "attention config nested apart", "dots3_note": "a composite config",
    "dots3_note_text": "per-layer attention sizes", "emu3": "a composite config",
    "gemma3n_text": "layers sharing caches set apart", "gemma4_assistant": "an assistant of a larger model",
    "gemma4_text": "per-layer head sizes", "gemma4_unified_text": "per-layer head sizes",
    "llama4": "a composite config", "qwen3_5": "a composite config", "qwen3_5_moe": "a composite config",
    "qwen4_exp": "a composite config", "qwen4_exp_text": "per-layer sizes set apart",
    "cohere_compass_text": "per-layer attention sizes", "falcon": "head_dim derived, not set",
    "gpt_neo": "attention layer pattern sized apart", "lfm2_moe": "layer pattern sized apart",
    "mamba2": "state sizes tied to the hidden size", "prophetnet": "encoder-decoder layers",
    "reformer": "an encoder unless configured as a decoder", "xlnet": "no sequence length limit",
    "zamba": "layer pattern sized apart", "zamba2": "layer pattern sized apart",
    "zaya": "one expert per token only", "beam": "attention sizes set apart",
    "inkling2_text": "vocabulary sized apart",
}
TINY = {"window_size": 8, "chunk_size": 4, "page_size": 8, "n_sinks": 4, "reselect": "always"}
PRESSES = (SnapKVPress, ChunkPress, SentencePress, CHESSPress, H2OPress, StreamingLLMPress)
LENGTH, NEW = 48, 6


def model_types() -> list[str]:
    """Every causal LM transformers maps, but encoder-decoders (their decoders are not decoder-only models)."""
    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                  if t in NOT_BUILT or not getattr(CONFIG_MAPPING[t](), "is_encoder_decoder", False))


def tiny_model(model_type: str, impl: str = "sdpa") -> torch.nn.Module:
    """The model type's causal LM, tiny (`SIZES`), random, in float32."""
    config_cls = CONFIG_MAPPING[model_type]
    defaults = config_cls()
    sizes = dict(SIZES)
    if hasattr(defaults, "qk_rope_head_dim"):
        del sizes["head_dim"]
        sizes.update(LATENT)
    config = config_cls(**{k: v for k, v in sizes.items() if hasattr(defaults, k)})
    if getattr(defaults, "sliding_window", None) and getattr(defaults, "layer_types", None) is None and \
            "full_attention" not in architectures.get_layer_types_and_kwargs(config)[0]:
        # A window on every layer by default (Mistral's 4096): the configs of the models that have none
        try:
            config = config_cls(**{k: v for k, v in sizes.items() if hasattr(defaults, k)}, sliding_window=None)
        except Exception:  # noqa: BLE001 (a config that wants one: keep its own)
            pass
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    if impl == "sdpa" and not model_cls._supports_sdpa:
        impl = "eager"
    config._attn_implementation = impl
    with torch.device("meta"):  # (a default size of a sub-model could be billions of parameters)
        size = sum(p.numel() for p in model_cls(config).parameters())
    if size > 20e6:
        raise ValueError(f"{size / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # peaked attention, as tests/conftest.py's models
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(4.0)
    model.generation_config.pad_token_id = 0
    return model


def tiny_press(cls, **budget) -> Press:
    names = {f.name for f in dataclasses.fields(cls)}
    args = (make_tokenizer(),) if "tokenizer" in names else ()
    return cls(*args, **{k: v for k, v in TINY.items() if k in names}, **budget)


@dataclasses.dataclass(kw_only=True)
class AttentionProbe(Press):
    """Keeps everything; at the prompt, keeps each layer's attention as sparsekv rebuilds it (`prefill_probs`: the
    layer's queries from its inputs), to compare with the weights eager attention returns."""

    rebuilt: dict = dataclasses.field(default_factory=dict, compare=False)

    def compress(self, ctx):
        n = ctx.keys.shape[-2]
        probs = ctx.attention(0, n)  # (batch, kv_heads, group, q, k)
        self.rebuilt[ctx.layer_idx] = probs.reshape(probs.shape[0], -1, n, n)


def greedy(model, ids, **kwargs):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          **kwargs)


def bound(press, cache) -> float:
    """The most tokens a compressed layer may attend at the end (per sequence), at ratio 0.25 of the prompt."""
    budget = int(cache.budgets[0]) if cache.budgets is not None else LENGTH
    if isinstance(press, (H2OPress, StreamingLLMPress)):
        return budget
    if isinstance(press, SentencePress):
        return budget + press.n_sinks + press.window_size + NEW - 1
    if isinstance(press, CHESSPress):
        return LENGTH + NEW - 1  # it attends whole pages (checked apart: fewer than it holds)
    return budget + NEW - 1


class _Everything:
    def __contains__(self, name):
        return True


@contextlib.contextmanager
def every_attention_verified():
    """sparsekv's checks but for the list of verified attention classes: what the walk itself decides."""
    listed, architectures.VERIFIED = architectures.VERIFIED, _Everything()
    try:
        yield
    finally:
        architectures.VERIFIED = listed


def refusal(model) -> str | None:
    """The message `with press(model):` refuses `model` with (the same under every press), or None."""
    arch, messages = type(model).__name__, set()
    for cls in PRESSES:
        try:
            with tiny_press(cls, ratio=0.25)(model):
                pass
        except ValueError as err:
            assert f"sparsekv cannot serve {arch}: " in str(err), str(err)
            messages.add(str(err))
    assert len(messages) in (0, len(PRESSES)) or len(messages) == 1, messages
    return messages.pop() if messages else None


def serves(model, model_type: str) -> float:
    """Assert that every press generates as the model does at ratio=1.0 and holds its budget at ratio=0.25;
    return the largest gap between the attention sparsekv rebuilds and the module's own (eager)."""
    arch = type(model).__name__
    ids = torch.randint(3, 256, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    plain = greedy(model, ids)
    for cls in PRESSES:
        with tiny_press(cls, ratio=1.0)(model):
            assert torch.equal(greedy(model, ids), plain), f"{arch}: {cls.__name__} at ratio=1.0"
        press = tiny_press(cls, ratio=0.25)
        with press(model):
            cache = greedy(model, ids, return_dict_in_generate=True).cache
        stats = cache.stats()
        attended = [stats.attended_tokens[i] for i, layer in enumerate(cache.layers)
                    if layer in cache.compressed_layers()]
        assert attended and max(attended) <= bound(press, cache), f"{arch}: {cls.__name__} attends {attended}"
        assert min(attended) < stats.logical_tokens, f"{arch}: {cls.__name__} compressed nothing"
    probe = AttentionProbe(ratio=1.0)
    eager = tiny_model(model_type, "eager")
    try:
        eager(ids)
    except RuntimeError:  # its eager attention fails at this size in transformers itself: nothing to compare
        return float("inf")
    weights = {}  # the weights each attention module returns (eager's), by layer

    def returned(module, args, output):
        weights[module.layer_idx] = output[1]

    hooks = [module.register_forward_hook(returned) for module in architectures.check_model(eager)]
    try:
        with probe(eager), torch.no_grad():
            eager(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return max(float((rebuilt - weights[i].float()[..., :rebuilt.shape[-1]]).abs().max())
               for i, rebuilt in probe.rebuilt.items())


@functools.lru_cache(maxsize=None)
def outcome(model_type: str) -> tuple[str, str]:
    """("works", ""), ("refused", the message) or ("not built", why), after asserting what each means: an
    architecture refused for its attention class rebuilds attention other than the module's own, and one whose
    attention class is verified serves every press."""
    if model_type in NOT_BUILT:
        with pytest.raises(Exception):  # noqa: B017 (any error: transformers cannot build it, or run it, so small)
            model = tiny_model(model_type)
            greedy(model, torch.arange(3, 3 + LENGTH)[None])
        return "not built", NOT_BUILT[model_type]
    model = tiny_model(model_type)
    with every_attention_verified():
        static = refusal(model)
    if static:
        return "refused", static
    with every_attention_verified():
        gap = serves(model, model_type)
    message = refusal(model)
    classes = {type(m).__name__ for m in check_targets(model)}
    if gap < 1e-4:
        assert message is None, f"{classes} rebuild attention as the module does: add to VERIFIED ({message})"
        return "works", ""
    assert message is not None, f"{classes} rebuild attention {gap:.2e} off the module's: not VERIFIED"
    return "refused", message


def check_targets(model) -> list:
    with every_attention_verified():
        return architectures.check_model(model)


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        level = logging.getLogger("transformers").level
        logging.getLogger("transformers").setLevel(logging.ERROR)
        yield
        logging.getLogger("transformers").setLevel(level)


@pytest.mark.parametrize("model_type", model_types())
def test_each_architecture_works_or_is_refused_at_entry(model_type):
    outcome(model_type)


def supported() -> list[str]:
    """The architectures that work, by class name."""
    names = {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t] for t in model_types() if outcome(t)[0] == "works"}
    return sorted(names, key=str.lower)


def test_the_readme_lists_the_architectures_that_work():
    found = re.search(r"<!-- architectures -->\n(.*?)\n<!-- /architectures -->", README.read_text(), re.S)
    assert found, "README.md has no <!-- architectures --> list"
    listed = re.findall(r"`(\w+)`", found.group(1))
    assert listed == supported(), "README's list is stale; `python tests/test_architectures.py` prints it"


if __name__ == "__main__":  # the README's list, and every refusal
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    print(", ".join(f"`{name}`" for name in supported()))
    for t in model_types():
        kind, why = outcome(t)
        if kind != "works":
            print(f"{t}: {kind}: {why}", file=sys.stderr)
