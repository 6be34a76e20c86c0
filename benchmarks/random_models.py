"""Models of real shapes with random weights, built from configs on the device: speed and memory do not depend on
the weights' values, and a GPU machine without the Hub cannot download them.

    from random_models import random_model
    model = random_model("llama-3.1-8b", "cuda", torch.bfloat16)  # 8.0B parameters, built on the GPU
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from sparsekv.cli import placement, placement_args
from sparsekv.models import load_model, load_tokenizer

# The published configs' shapes (config.json of each model on the Hub), rope included: its scaling changes the
# step's work only through the rotary embedding, but a 128k prompt needs Llama 3.1's context.
SHAPES = {
    "llama-3.1-8b": lambda: LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "qwen2.5-0.5b": lambda: Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "smollm2-135m": lambda: LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    # Not a published model: Llama-3.1-8B's 32 layers and 32 / 8 heads at widths that cost nothing, so that a
    # decoding step on a CPU is its host work (Python and op dispatch), as a batch-1 step of the 8B model is on
    # a GPU: the press / oracle ratios of that regime, without a GPU.
    "host-bound": lambda: LlamaConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=256, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
}


def random_model(shape: str, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 attn_implementation: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A model of `shape` (a key of `SHAPES`) with the config's random initialisation, built directly on `device`
    in `dtype` (no full-precision copy on the host), in eval mode."""
    if shape not in SHAPES:
        raise ValueError(f"--shape: one of {', '.join(SHAPES)}; got {shape!r}.")
    config = SHAPES[shape]()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


# --- the benchmarks' model options ---------------------------------------------------------------------------------
def model_arguments(parser: argparse.ArgumentParser, shape_only: bool = False) -> None:
    """Which model and where, for the GPU benchmarks: `--model` (unless `shape_only`) or `--shape` with
    `--tokenizer`, sparsekv's placement options (`sparsekv.cli.placement_args`) and `--cudnn-sdpa`."""
    add = parser.add_argument
    if not shape_only:
        add("--model", default="smollm2-135m", help="alias, .gguf file or folder (default: %(default)s)")
    add("--shape", choices=SHAPES, required=shape_only,
        help="a model of this shape with random weights, built on --device" + ("" if shape_only else
                                                                              " (instead of --model)"))
    add("--tokenizer", required=shape_only, help="tokenizer for --shape: an alias (smollm2-135m), .gguf file or "
        "folder (any, with a chat template: only the prompts' lengths matter)")
    placement_args(parser)
    add("--cudnn-sdpa", action="store_true", help="let sdpa pick cuDNN attention (off by default: torch 2.11 "
        "rebuilds its plan for every new KV length, ~1.2 ms of host time per layer and step; docs/gpu.md)")
    parser.set_defaults(parser=parser)  # `placement` reports bad values through it


def model_placement(args: argparse.Namespace) -> tuple[str, torch.dtype]:
    """`(device, dtype)` of the parsed `model_arguments`, with cuDNN attention off unless `--cudnn-sdpa`; bad
    values exit through the parser."""
    if not args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.shape and not args.tokenizer:
        args.parser.error("--shape: give --tokenizer (an alias such as smollm2-135m, a .gguf file or a folder).")
    if args.shape and args.device_map:
        args.parser.error("--device-map: not with --shape (its model is built on --device).")
    return placement(args)


def load_from_arguments(args: argparse.Namespace, device: str, dtype: torch.dtype):
    """`(model, tokenizer, name)` of the parsed `model_arguments`, placed as `model_placement` said."""
    if args.shape:
        return (random_model(args.shape, device, dtype, args.attn_implementation),
                load_tokenizer(args.tokenizer), f"{args.shape} (random weights)")
    model, tokenizer = load_model(args.model, dtype, args.attn_implementation, device_map=device)
    return model, tokenizer, args.model
