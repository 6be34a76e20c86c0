"""Where a decoding step's time goes, per press against the oracle: wall time, the device's busy time and the
kernels launched per step (torch.profiler), and the ops that cost the most host and device time.

A step the device spends mostly idle is bound by the host (Python and kernel launches): there a press's extra
ops cost their launch, not their arithmetic, and only fewer ops make it faster.

    python -m benchmarks.profile_step --shape llama-3.1-8b --tokenizer TOKENIZER_DIR --device cuda \\
        --length 32768 --presses snapkv,streamingllm

`--diff` lists, per press, the ops whose host time of their own a step exceeds the oracle's the most.
`--compiled` profiles compiled steps instead (each press with `compile=True`, the oracle over transformers' static
cache, generate's steps from its 8th token on): beside the wall time, the guard check before each step (dynamo's
cache lookup) and the host time of the step's graphs; with `--diff`, the code inductor generates for them as one
row. The guard check and that code are what a press adds to a compiled step on a host-bound shape, and they hold
steadier between runs than wall time does (docs/compiled.md). The configurations are profiled in `--rounds`, each
profiling every one once; "by round" is the median of each round's ratio to the oracle.

    python -m benchmarks.profile_step --shape host-bound --tokenizer smollm2-135m --device cpu --dtype float32 \\
        --length 4096 --compiled --steps 32 --presses streamingllm,snapkv,h2o --diff

`--python N` also profiles the same steps with cProfile and lists the N functions with the most time of their own
(Python, and the C functions it calls): where a step's host time goes that no aten op shows (hooks, dispatch in
sparsekv's own code, CUDA driver queries).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm
from transformers import CompileConfig

from sparsekv.evaluation.presses import make_press
from sparsekv.presses.registry import split_specs
from sparsekv.table import format_table

from . import compiled_decode
from .compiled_decode import StepClock
from .decode_vs_oracle import needle_prompt
from .random_models import load_from_arguments, model_arguments, model_placement


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def profile_steps(model, ids: torch.Tensor, context, steps: int, top: int, python: int = 0) -> tuple[dict, str]:
    """Prefill `ids` in `context`, warm up 3 steps, then time and profile `steps` greedy steps (`python`: then
    `steps` more under cProfile, its `python` functions with the most time of their own listed too)."""
    cuda = ids.is_cuda
    with context:
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)

        def decode(n: int) -> None:  # `n` greedy steps from the cache, waited for
            nonlocal token
            for _ in range(n):
                token = model(token, cache=cache).logits[:, -1:].argmax(-1)
            sync(ids.device)

        decode(3)
        start = time.perf_counter()
        decode(steps)
        wall = (time.perf_counter() - start) * 1000 / steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            decode(steps)
        python_table = ""
        if python:
            profiler = cProfile.Profile()
            profiler.runcall(decode, steps)
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).strip_dirs().sort_stats("tottime").print_stats(python)
            python_table = f"\ncProfile, {steps} steps, by time of their own:\n{stream.getvalue().strip()}\n"
    events = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    row = {"wall_ms": wall, "ops": sum(e.count for e in events if e.key.startswith("aten::")) / steps,
           "kernels": len(kernels) / steps,
           "device_ms": sum(e.device_time for e in kernels) / 1000 / steps if cuda else None}
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    tables = [events.table(sort_by=sort, row_limit=top), events.table(sort_by="cpu_time_total", row_limit=top)]
    row["per_op"] = {e.key: (e.count / steps, e.self_cpu_time_total / 1000 / steps) for e in events}
    return row, "\n".join(tables) + python_table


class ProfiledSteps(StepClock):
    """A step clock that also profiles the `steps` decoding steps from the `start`th token on."""

    def __init__(self, start: int, steps: int, device: torch.device):
        super().__init__(device)
        self.start, self.steps, self.prof = start, steps, None

    def put(self, value: torch.Tensor) -> None:
        super().put(value)
        if len(self.times) == self.start:
            self.prof = profile(activities=[ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if self.device.type == "cuda" else []))
            self.prof.__enter__()
        if len(self.times) == self.start + self.steps:
            self.prof.__exit__(None, None, None)


FIRST_PROFILED = 8  # the streamer's put (the prompt's is the first) after which a compiled step is profiled


def profile_compiled(run, device: torch.device, steps: int, top: int) -> tuple[dict, str]:
    """Profile `steps` steps of a compiled configuration's generation (a function of
    `compiled_decode.configurations`, of at least `FIRST_PROFILED + steps` new tokens), run twice before (the
    first compiling)."""
    clock, _, _ = run(ProfiledSteps(FIRST_PROFILED, steps, device))
    events = clock.prof.key_averages()
    profiled = clock.times[FIRST_PROFILED - 1:FIRST_PROFILED + steps]
    gaps = sorted(b - a for a, b in zip(profiled, profiled[1:]))

    def per_step(match) -> float:  # ms a step, host time: the events whose name `match` accepts
        return sum(e.cpu_time_total for e in events if match(e.key)) / 1000 / steps

    row = {"wall_ms": gaps[len(gaps) // 2] * 1000,
           "guard_ms": per_step(lambda key: key == "TorchDynamo Cache Lookup"),
           "graphs_ms": per_step(lambda key: key.startswith("Torch-Compiled Region")),
           "graphs": sum(e.count for e in events if e.key.startswith("Torch-Compiled Region")) / steps,
           "ops": sum(e.count for e in events if e.key.startswith("aten::")) / steps,
           "per_op": {}}
    for e in events:  # a graph's events are named by its hash: one name for all, so that --diff compares them
        key = GRAPH_NAMES.get(e.key.split()[2] if e.key.startswith("## Call") else e.key.split(":")[0], e.key)
        calls, ms = row["per_op"].get(key, (0, 0.0))
        row["per_op"][key] = (calls + e.count / steps, ms + e.self_cpu_time_total / 1000 / steps)
    return row, events.table(sort_by="self_cpu_time_total", row_limit=top)


GRAPH_NAMES = {"CompiledFxGraph": "compiled graphs (inductor's code, beside the aten ops they call)",
               "Torch-Compiled Region": "compiled regions (their own host time)"}


def op_differences(press: dict, oracle: dict, top: int) -> list[dict]:
    """The `top` ops whose host time of their own per step (ms) exceeds the oracle's the most: calls and ms a
    step against the oracle's (ops the model runs either way cancel out, what is left is the press's)."""
    rows = []
    for key in press.keys() | oracle.keys():
        (calls, ms), (oracle_calls, oracle_ms) = press.get(key, (0, 0.0)), oracle.get(key, (0, 0.0))
        rows.append({"op": key, "calls": calls - oracle_calls, "ms": ms - oracle_ms})
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    model_arguments(parser)
    add("--length", type=int, default=8192, help="prompt tokens (default: %(default)s)")
    add("--batch", type=int, default=1, help="copies of the prompt (default: %(default)s)")
    add("--presses", default="snapkv,streamingllm", help="(default: %(default)s)")
    add("--ratio", type=float, default=0.1, help="(default: %(default)s)")
    add("--steps", type=int, default=8, help="steps timed and profiled (default: %(default)s)")
    add("--top", type=int, default=12, help="ops listed per configuration (default: %(default)s)")
    add("--diff", action="store_true", help="also list, per press, the ops whose host time of their own a step "
        "exceeds the oracle's the most (--top of them)")
    add("--python", type=int, default=0, metavar="N", help="also profile the steps with cProfile and list its N "
        "functions with the most time of their own (default: none)")
    add("--compiled", action="store_true", help="profile compiled steps (each press with compile=True, the "
        "oracle in transformers' static cache) through generate")
    add("--rounds", type=int, default=3, help="with --compiled: rounds, each profiling every configuration once "
        "(default: %(default)s)")
    args = parser.parse_args(argv)
    model, tokenizer, model_name = load_from_arguments(args, *model_placement(args))
    if args.compiled:
        return main_compiled(args, model, tokenizer, model_name)
    ids = needle_prompt(tokenizer, args.length).to(model.device).expand(args.batch, -1)
    configs = {"oracle": (ids[:, -round(args.ratio * args.length):], contextlib.nullcontext())}
    for spec in split_specs(args.presses):
        configs[spec] = (ids, make_press(spec, ratio=args.ratio, tokenizer=tokenizer)(model))
    rows = []
    for name, (prompt, context) in configs.items():
        row, tables = profile_steps(model, prompt, context, args.steps, args.top, args.python)
        rows.append({"config": name, **row})
        print(f"\n== {name}\n{tables}")
    per_op = {row["config"]: row.pop("per_op") for row in rows}
    if args.diff:
        for name in list(configs)[1:]:
            print(f"\n{name} against the oracle, per step: ops with the most extra host time of their own")
            print(format_table(op_differences(per_op[name], per_op["oracle"], args.top),
                               [("op", "op", ""), ("extra calls", "calls", "+.1f"), ("extra ms", "ms", "+.3f")]))
    print(f"\n{model_name}, {args.length}-token prompt, batch {args.batch}, ratio {args.ratio}: per step")
    print(format_table(rows, [("config", "config", ""), ("wall ms", "wall_ms", ".2f"),
                              ("device busy ms", "device_ms", ".2f"), ("aten ops", "ops", ".0f"),
                              ("kernels", "kernels", ".0f")]))


def main_compiled(args, model, tokenizer, model_name) -> None:
    ids = needle_prompt(tokenizer, args.length).to(model.device).expand(args.batch, -1)
    config = CompileConfig()
    config._compile_all_devices = True  # (transformers compiles on a GPU only, unless told)
    specs = split_specs(args.presses)
    runs = compiled_decode.configurations(model, ids, specs, args.ratio, FIRST_PROFILED + args.steps, config,
                                          tokenizer)
    names = ["oracle", *specs]
    for name in tqdm(names, desc="compiling", leave=False):
        runs[f"{name} compiled"](), runs[f"{name} compiled"]()
    # Rounds: each profiles every configuration once, so that a slow moment of the machine moves a press and the
    # oracle alike; a round's ratio is its press's host time against its oracle's (the median reported).
    rounds = []
    for _ in tqdm(range(args.rounds), desc="profiling rounds", leave=False):
        rounds.append({name: profile_compiled(runs[f"{name} compiled"], model.device, args.steps, args.top)
                       for name in names})
    for name in names:
        print(f"\n== {name} compiled (last round)\n{rounds[-1][name][1]}")
    rows, per_op = [], {}
    for name in names:
        results = [r[name][0] for r in rounds]
        per_op[name] = {key: tuple(statistics.mean(r["per_op"].get(key, (0, 0.0))[i] for r in results)
                                   for i in range(2)) for key in set().union(*(r["per_op"] for r in results))}
        row = {key: statistics.median(r[key] for r in results)
               for key in ("wall_ms", "guard_ms", "graphs_ms", "graphs", "ops")}
        row["by_round"] = statistics.median(host(r[name][0]) / host(r["oracle"][0]) for r in rounds)
        rows.append({"config": name, **row})
    oracle = rows[0]
    for row in rows:
        row["host_ratio"] = host(row) / host(oracle)
    if args.diff:
        for name in specs:
            print(f"\n{name} compiled against the compiled oracle, per step: ops with the most extra host time")
            print(format_table(op_differences(per_op[name], per_op["oracle"], args.top),
                               [("op", "op", ""), ("extra calls", "calls", "+.1f"), ("extra ms", "ms", "+.3f")]))
    print(f"\n{model_name}, {args.length}-token prompt, batch {args.batch}, ratio {args.ratio}, compiled: per step "
          f"(host ms: profiled, {args.steps} steps; medians of {args.rounds} rounds)")
    print(format_table(rows, [("config", "config", ""), ("wall ms", "wall_ms", ".2f"),
                              ("guard check ms", "guard_ms", ".2f"), ("graphs ms", "graphs_ms", ".2f"),
                              ("graphs", "graphs", ".0f"), ("aten ops", "ops", ".0f"),
                              ("(guards + graphs) / oracle's", "host_ratio", ".3f"), ("by round", "by_round", ".3f")]))


def host(row: dict) -> float:
    """A compiled configuration's host time a step: its guard check and its graphs."""
    return row["guard_ms"] + row["graphs_ms"]


if __name__ == "__main__":
    main()
