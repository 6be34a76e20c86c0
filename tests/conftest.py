"""Tiny random models of every supported architecture, built from configs (no downloads)."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# The notebooks (collected from notebooks/ by nbmake) run with small settings; they load the offline SmolLM2.
# Set here, not in a notebooks/conftest.py, whose module name would shadow this one for `from conftest import`.
os.environ.setdefault("SPARSEKV_NOTEBOOK_FAST", "1")  # read by each notebook; the kernel inherits it


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="torch device the tiny models and their inputs are put on, e.g. cuda (default: cpu)")


DEVICE = torch.device("cpu")  # set from --device before collection; read at call time, never copied


def pytest_configure(config):
    global DEVICE
    DEVICE = torch.device(config.getoption("--device"))
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: CUDA is not available here.")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"partial_rotary_factor": 0.5}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention", "full_attention"]},
    ),
}
IMPLEMENTATIONS = ("eager", "sdpa")
# A minimal chat template for the in-memory tokenizers.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_model(arch: str = "llama", impl: str = "sdpa", seed: int = 0, **overrides) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    config = config_cls(**{**COMMON, **extra, **overrides})
    config._attn_implementation = impl
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init gives near-uniform attention; larger weights make attention (and so selection) peaked.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(4.0)
    return model.to(DEVICE)


@pytest.fixture(params=[(a, i) for a in ARCHITECTURES for i in IMPLEMENTATIONS], ids=lambda p: f"{p[0]}-{p[1]}")
def any_model(request):
    arch, impl = request.param
    return make_model(arch, impl)


def prompt(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g).to(DEVICE)


def greedy(model, ids, mask=None, new=8, **kwargs):
    return model.generate(
        ids, attention_mask=mask if mask is not None else torch.ones_like(ids), max_new_tokens=new,
        do_sample=False, pad_token_id=0, **kwargs,
    )


def save_model_dir(tmp_path_factory, model, tokenizer):
    """A tiny model and its tokenizer saved as a local model folder, for the command line."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


TRICKY = (
    "Dr. Smith paid $3.50 for the U.S. edition. It was 2.5 times cheaper.\n"
    '"Is it good?" she asked. "Yes."\nThe end.\n\n'
    "x = 1.5\nprint(x)\n\ndef f():\n    return x\n\n"
    "The committee reviewed every single proposal very carefully before the final vote was taken. "
    "Most members agreed that the second proposal was by far the strongest of all the candidates. "
)


@functools.lru_cache(maxsize=None)
def byte_tokenizer():
    """A byte-level tokenizer of exactly the tiny models' vocabulary (the 256 bytes, no merges, no special token):
    for a press that feeds the model text of its own (KVzip's instruction)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["x"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def make_tokenizer():
    """A byte-level BPE (vocabulary > 256, so it decodes every id of the tiny models) trained in memory on text
    full of punctuation, so that tokens such as `.\\n` and `."` exist."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen2 / Llama-3 style splitting: punctuation keeps its trailing newlines (tokens like `.\n`).
    split = pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                                       r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), "isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRICKY] * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
