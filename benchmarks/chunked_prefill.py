"""A long prompt read in pieces (generate's `prefill_chunk_size`) under a press: the prefill's peak memory
and time against the prompt in one forward, and whether the answer is the same.

The press compresses the prompt after its last piece as it would the whole prompt (`cache.PromptPieces`), so
the tokens kept and the answer do not change; what changes is the prefill's working memory, which holds one
piece's activations instead of the prompt's (the uncompressed KV of the prompt is held either way until the
press compresses it). Memory is the peak above the level before the generation: resident memory on a CPU
(sampled, `sparsekv.bench.PeakRSS`), `torch.cuda.max_memory_allocated` on a GPU.

    python -m benchmarks.chunked_prefill --length 8000 --chunks 0,1024 --presses snapkv,streamingllm
    python -m benchmarks.chunked_prefill --shape llama-3.1-8b --tokenizer TOKENIZER_DIR \\
        --device cuda --length 32768 --chunks 0,2048,8192
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from sparsekv.bench import PeakRSS, timed_generate
from sparsekv.bench.timing import _release_memory
from sparsekv.evaluation.presses import make_press
from sparsekv.presses.registry import split_specs
from sparsekv.table import format_table

from .decode_vs_oracle import needle_prompt
from .random_models import load_from_arguments, model_arguments, model_placement


def run(model, ids: torch.Tensor, press, chunk: int, new_tokens: int) -> dict:
    """One greedy generation; `chunk` 0: the prompt in one forward."""
    _release_memory()
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats(ids.device)
        base = torch.cuda.memory_allocated(ids.device)
    extra = {"prefill_chunk_size": chunk} if chunk else {}
    with PeakRSS() as rss, press(model) if press is not None else contextlib.nullcontext():
        out, _, stamps = timed_generate(model, ids, new_tokens, min_new_tokens=new_tokens, **extra)
    peak = (torch.cuda.max_memory_allocated(ids.device) - base) / 2**20 if cuda else rss.peak_mb
    return {"prefill_s": stamps[0], "peak_mb": peak, "answer": out.sequences[0, ids.shape[1]:].tolist()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    model_arguments(parser)
    add("--length", type=int, default=8000, help="prompt tokens (default: %(default)s)")
    add("--chunks", default="0,1024", help="prefill_chunk_size values, 0 for one forward (default: %(default)s)")
    add("--presses", default="snapkv,chunkkv,streamingllm,chess", help="(default: %(default)s; the full cache "
        "is measured besides)")
    add("--ratio", type=float, default=0.1, help="fraction of the prompt's KV kept (default: %(default)s)")
    add("--new-tokens", type=int, default=8, help="tokens generated (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        chunks = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        parser.error(f"--chunks: comma-separated integers; got {args.chunks!r}.")
    if 0 not in chunks or min(chunks) < 0:
        parser.error("--chunks: include 0 (the prompt in one forward, which the others are compared with), and no "
                     "negative size.")
    model, tokenizer, name = load_from_arguments(args, *model_placement(args))
    ids = needle_prompt(tokenizer, args.length).to(model.device)
    configs = {"full": None, **{spec: make_press(spec, ratio=args.ratio, tokenizer=tokenizer)
                                for spec in split_specs(args.presses)}}
    rows = []
    with torch.no_grad():
        for label, press in configs.items():
            whole = None
            for chunk in sorted(chunks):
                try:
                    result = run(model, ids, press, chunk, args.new_tokens)
                except ValueError as err:  # a press that cannot read a prompt in pieces says so
                    print(f"{label}, prefill_chunk_size={chunk}: {err}")
                    continue
                whole = whole or result
                rows.append({"config": label, "chunk": chunk or "one forward", "prefill_s": result["prefill_s"],
                             "peak_mb": result["peak_mb"], "peak_ratio": result["peak_mb"] / whole["peak_mb"],
                             "same": "yes" if result["answer"] == whole["answer"] else "no"})
    device = "CUDA max_memory_allocated" if ids.is_cuda else "peak RSS"
    print(f"\n{name}, {ids.shape[1]}-token prompt, ratio {args.ratio}, {args.new_tokens} new tokens; memory: "
          f"{device} above the level before each generation")
    print(format_table(rows, [("config", "config", ""), ("prefill_chunk_size", "chunk", ""),
                              ("prefill s", "prefill_s", ".2f"), ("peak MB", "peak_mb", ".0f"),
                              ("peak / one forward", "peak_ratio", ".2f"), ("same answer", "same", "")]))


if __name__ == "__main__":
    main()
