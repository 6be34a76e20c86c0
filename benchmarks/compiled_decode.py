"""Decoding steps compiled by generate (its `compile_config`) against eager, under each press whose steps compile
and for the oracle, timed inside `generate` itself.

The oracle is the full model on the prompt's last `ratio * length` tokens: eager with transformers' dynamic
cache, compiled with its static cache (what transformers compiles). A press runs on the cache it makes, compiled
made with `compile=True` (generate then makes it with room for `--new` tokens). Every configuration generates
`--new` tokens from the same random prompt, `--repeats` times, the configurations interleaved so that they share
the machine's load of the moment; a step is the interval between two tokens as a streamer receives them (the
device synchronised), and the first `--warmup` steps are left out: a compiled generation traces and records
there. A compiled configuration's compile time is its first generation's time beyond its median generation's.

    python -m benchmarks.compiled_decode --shape host-bound --length 2048 --presses streamingllm,h2o,snapkv,chunkkv
    python -m benchmarks.compiled_decode --shape host-bound --tokenizer smollm2-135m --presses sentencekv
    python -m benchmarks.compiled_decode --model smollm2-135m --length 4096 --presses streamingllm,h2o,snapkv,chunkkv
    python -m benchmarks.compiled_decode --shape llama-3.1-8b --device cuda --length 32768 --batch 1,8

On a CPU, transformers compiles only when told to (`CompileConfig._compile_all_devices`), which this does. The
oracle compiles with transformers' `CompileConfig` (`--backend`, `--mode`), a press with the same through
`sparsekv.compile_config` (inductor's options for its steps, what `compile=True` compiles with).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers import CompileConfig, StaticCache

from sparsekv.cli import placement, placement_args
from sparsekv.cli.args import csv
from sparsekv.environment import environment
from sparsekv.evaluation.presses import make_press
from sparsekv.generation import compile_config
from sparsekv.models import load_model, load_tokenizer
from sparsekv.presses.registry import split_specs
from sparsekv.table import format_table

from .random_models import SHAPES, random_model


class StepClock:
    """A generate streamer that keeps the time each new token arrives (after the device caught up)."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def put(self, value: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def steps(self, warmup: int) -> list[float]:
        """Seconds of each decoding step after the first `warmup` (the first put is the prompt, the second the
        prefill's token)."""
        arrived = self.times[1:]
        return [b - a for a, b in itertools.pairwise(arrived)][warmup:]


def generation(model, ids: torch.Tensor, new: int, cache=None, compile_config=None,
               clock: StepClock | None = None) -> tuple[StepClock, float, torch.Tensor]:
    """One greedy generation of `new` tokens: its step clock (`clock`, or a new one), its seconds and its
    tokens."""
    clock = clock or StepClock(ids.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, cache=cache, compile_config=compile_config, streamer=clock,
                         pad_token_id=0)
    return clock, time.perf_counter() - start, out[:, ids.shape[1]:]


def configurations(model, ids: torch.Tensor, specs: list[str], ratio: float, new: int, config: CompileConfig,
                   tokenizer=None):
    """Per configuration name, a function that runs one generation of it, timed by the step clock it is given
    (or a new one): `(step clock, seconds, tokens)`; `tokenizer`: for presses that read text (SentenceKV)."""
    oracle_ids = ids[:, -max(1, round(ratio * ids.shape[1])):]
    runs = {
        "oracle eager": lambda clock=None: generation(model, oracle_ids, new, clock=clock),
        "oracle compiled": lambda clock=None: generation(
            model, oracle_ids, new, StaticCache(config=model.config, max_cache_len=oracle_ids.shape[1] + new),
            config, clock),
    }
    press_config = compile_config(config)  # the oracle's settings, with sparsekv's inductor options
    for spec in specs:
        def run(clock=None, spec=spec, compiled=False):
            press = make_press(spec, ratio=ratio, tokenizer=tokenizer)
            with dataclasses.replace(press, compile=compiled)(model):  # (room: generate's)
                return generation(model, ids, new, None, press_config if compiled else None, clock)

        runs[f"{spec} eager"] = run
        runs[f"{spec} compiled"] = lambda clock=None, run=run: run(clock, compiled=True)
    return runs


@torch.no_grad()
def measure(model, ids: torch.Tensor, specs: list[str], ratio: float, new: int, warmup: int, repeats: int,
            config: CompileConfig, tokenizer=None) -> list[dict]:
    """One row per configuration: median step (ms) and quartiles, its ratio to the oracle's of the same mode
    (pooled medians, and the median of each round's ratio: a round is one generation of every configuration, so
    a slow moment of the machine moves both sides of its ratio), compile seconds, and whether the compiled
    tokens equal the eager ones. A configuration that fails is left out of the table, its error printed (the
    others still run: a GPU machine's minutes are few)."""
    runs = configurations(model, ids, specs, ratio, new, config, tokenizer)
    steps = {name: [] for name in runs}
    seconds = {name: [] for name in runs}
    rounds = {name: {} for name in runs}  # per repeat: the generation's median step
    tokens, failed = {}, set()
    progress = tqdm(total=repeats * len(runs), desc=f"generations, batch {ids.shape[0]}")
    for repeat in range(repeats):
        for name, run in runs.items():
            progress.update()
            if name in failed:
                continue
            try:
                clock, took, out = run()
            except Exception as err:  # noqa: BLE001 (reported, and the other configurations go on)
                print(f"{name}, batch {ids.shape[0]}: failed: {type(err).__name__}: {err}"[:2000])
                failed.add(name)
                continue
            timed = clock.steps(warmup)
            steps[name] += timed
            rounds[name][repeat] = statistics.median(timed)
            seconds[name].append(took)
            tokens.setdefault(name, out)
    progress.close()
    eager = {name.removesuffix(" eager"): statistics.median(v) for name, v in steps.items()
             if name.endswith("eager") and v}
    rows = []
    for name, v in steps.items():
        base, kind = name.rsplit(" ", 1)
        if not v:
            continue
        q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
        ms = 1000 * statistics.median(v)
        rows.append({
            "config": base, "mode": kind, "batch": ids.shape[0], "length": ids.shape[1], "ms": ms,
            "quartiles": f"{1000 * q[0]:.2f}-{1000 * q[2]:.2f}", "steps": len(v),
            "vs_eager": ms / (1000 * eager[base]) if base in eager else None,
            "compile_s": seconds[name][0] - statistics.median(seconds[name][1:]) if kind == "compiled" and
            repeats > 1 else None,
            "same_tokens": None if kind == "eager" or f"{base} eager" not in tokens else
            bool(torch.equal(tokens[name], tokens[f"{base} eager"])),
        })
    oracle = {row["mode"]: row["ms"] for row in rows if row["config"] == "oracle"}
    for row in rows:
        row["vs_oracle"] = row["ms"] / oracle[row["mode"]] if row["mode"] in oracle else None
        mine, theirs = rounds[f"{row['config']} {row['mode']}"], rounds[f"oracle {row['mode']}"]
        ratios = [mine[r] / theirs[r] for r in mine if r in theirs]
        row["vs_oracle_rounds"] = statistics.median(ratios) if ratios else None
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or folder (default: %(default)s)")
    source.add_argument("--shape", choices=SHAPES, help="a model of this shape with random weights (instead of "
                                                        "--model), built on --device")
    placement_args(parser)
    parser.add_argument("--presses", default="streamingllm,h2o,snapkv,chunkkv",
                        help="comma-separated, with options as in `sparsekv bench` (default: %(default)s)")
    parser.add_argument("--tokenizer", help="tokenizer for presses that read text (SentenceKV): an alias, .gguf "
                        "file or folder (default: --model's; with --shape, give one of its vocabulary's size)")
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--batch", type=csv(int), default=[1], help="rows decoded together, comma-separated "
                                                                   "(default: 1)")
    parser.add_argument("--ratio", type=float, default=0.1, help="fraction of the prompt's KV kept (default: 0.1)")
    parser.add_argument("--new", type=int, default=32, help="tokens generated per generation (default: 32)")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out (default: 4)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved generations per configuration "
                                                              "(default: 3)")
    parser.add_argument("--mode", default="reduce-overhead", help="torch.compile mode (default: %(default)s, "
                        "transformers' own: CUDA graphs on a GPU; 'default' for none)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default: %(default)s; "
                        "'eager' traces without generating code: a quick check, no speed)")
    parser.add_argument("--cudnn-sdpa", action="store_true", help="let sdpa pick cuDNN attention (off by default, "
                        "as in the other benchmarks: torch 2.11 rebuilds its plan for every new KV length, host "
                        "time an eager step of a growing cache pays; docs/gpu.md)")
    parser.add_argument("--json", metavar="FILE.json", help="write the rows and the environment")
    parser.set_defaults(parser=parser)
    args = parser.parse_args(argv)
    batches = args.batch
    if min(batches) < 1 or args.new < args.warmup + 2 or args.repeats < 1 or args.warmup < 0:
        parser.error("--batch and --repeats: at least 1; --warmup: at least 0; --new: at least --warmup + 2.")
    if not 0 < args.ratio <= 1:
        parser.error(f"--ratio: a fraction in (0, 1]; got {args.ratio}.")
    device, dtype = placement(args)
    if not args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    # Several configurations compile in one process: each its own static shapes. Dynamo would otherwise make the
    # sizes that differ between them symbolic at the second (automatic dynamic shapes), and inductor 2.11 fails to
    # guard some of those (an IndexError in `produce_guards`, seen on an H200).
    torch._dynamo.config.automatic_dynamic_shapes = False
    if args.shape:
        model, name = random_model(args.shape, device, dtype, args.attn_implementation), f"{args.shape} (random)"
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    else:
        model, tokenizer = load_model(args.model, dtype, args.attn_implementation, device_map=device)
        name, tokenizer = args.model, load_tokenizer(args.tokenizer) if args.tokenizer else tokenizer
    # Each configuration adds its own graphs to the one compiled forward (generate compiles `model.__call__`, and
    # dynamo keeps a graph per cache layout), more than dynamo's default limit of 8 per frame.
    torch._dynamo.config.recompile_limit = 64
    config = CompileConfig(backend=args.backend, mode=None if args.mode == "default" or args.backend != "inductor"
                           else args.mode)
    config._compile_all_devices = True  # (transformers compiles on a GPU only, unless told)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(3, vocab, (1, args.length), generator=torch.Generator().manual_seed(0))
    rows = []
    for batch in batches:
        rows += measure(model, prompt.expand(batch, -1).to(model.device), split_specs(args.presses), args.ratio,
                        args.new, args.warmup, args.repeats, config, tokenizer)
    env = environment(model.device)
    print(f"{name}, {env['device_name']}, {str(dtype).removeprefix('torch.')}, {args.attn_implementation}, "
          f"{args.length}-token prompt, ratio {args.ratio}, compiled by {args.backend} ({config.mode or 'default'}); "
          f"{args.repeats} generations of "
          f"{args.new} tokens per configuration, the first {args.warmup} steps left out")
    print(format_table(rows, [
        ("config", "config", ""), ("mode", "mode", ""), ("batch", "batch", ""), ("ms/step", "ms", ".2f"),
        ("quartiles", "quartiles", ""), ("steps", "steps", ""), ("/ eager", "vs_eager", ".3f"),
        ("/ oracle (same mode)", "vs_oracle", ".3f"), ("/ oracle, by round", "vs_oracle_rounds", ".3f"),
        ("compile s", "compile_s", ".1f"),
        ("tokens = eager", "same_tokens", "")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "length": args.length, "ratio": args.ratio, "new": args.new,
                       "warmup": args.warmup, "repeats": args.repeats, "backend": args.backend,
                       "cudnn_sdpa": args.cudnn_sdpa,
                       "mode": config.mode, "dtype": str(dtype),
                       "environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
