"""How many ops does a press add to a decoding step, and where? Ops dispatched per step, by sparsekv source line.

On a CPU a decoding step of a small model is bound by the count of small ops, not their size (docs/
decode_vs_oracle.md), so this counts them: every op torch dispatches during `--steps` one-token forwards from a
prefilled cache is charged to the innermost sparsekv line on the Python stack ("model" when there is none: the
model's own ops). The oracle is the full cache of the prompt's last `ratio * length` tokens, with no press.

    python -m benchmarks.step_ops --presses snapkv,h2o,sentencekv
    python -m benchmarks.step_ops --presses sentencekv --lines 20

`--host-reads` counts only the ops that bring a tensor's value to the host (`.item()`, `bool(t)`, `torch.equal`,
`nonzero`, boolean-mask indexing, ...): each is a host-device synchronisation on a GPU, found here on a CPU.

On a GPU (any model of `random_models.py`), each line's ops are split into those on the GPU (a kernel launch
each) and those on host tensors (an offloaded store's gathers, index arithmetic for it):

    python -m benchmarks.step_ops --shape llama-3.1-8b --tokenizer TOKENIZER_DIR --device cuda \
        --dtype bfloat16 --length 32768 --presses sentencekv,snapkv
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sparsekv.evaluation.presses import make_press
from sparsekv.presses.registry import split_specs

from .decode_vs_oracle import needle_prompt
from .random_models import load_from_arguments, model_arguments, model_placement

# Ops whose result needs a tensor's value on the host: on CUDA each waits for the device (a synchronisation).
HOST_READS = {"_local_scalar_dense", "equal", "nonzero", "masked_select", "_unique2", "unique_dim",
              "unique_consecutive", "repeat_interleave"}


def reads_on_host(func, args) -> bool:
    name = func.overloadpacket.__name__
    if name in ("index", "index_put", "index_put_"):  # a boolean mask index is a nonzero inside
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None)
    return name in HOST_READS


class OpsBySource(TorchDispatchMode):
    """Counts dispatched ops (`host_reads`: only those of `reads_on_host`) by the innermost `sparsekv/` frame
    that issued them."""

    def __init__(self, host_reads: bool = False):
        super().__init__()
        self.counts, self.on_host, self.host_reads = Counter(), Counter(), host_reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.host_reads and not reads_on_host(func, args):
            return func(*args, **(kwargs or {}))
        frame, where = sys._getframe(1), "model"
        while frame is not None:
            name = frame.f_code.co_filename
            if "/sparsekv/" in name:
                where = f"{name.split('/sparsekv/')[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
                break
            frame = frame.f_back
        self.counts[where] += 1
        if not any(on_gpu(leaf) for leaf in tree_leaves((args, kwargs))):
            self.on_host[where] += 1  # on a GPU model: an op on host tensors (no kernel launch)
        return func(*args, **(kwargs or {}))


def on_gpu(value) -> bool:
    """Whether an op's argument puts it on a GPU: a tensor there, or a factory's `device=`."""
    device = value.device if isinstance(value, torch.Tensor) else value if isinstance(value, torch.device) else None
    return device is not None and device.type != "cpu"


@torch.no_grad()
def count(model, ids: torch.Tensor, context, steps: int, host_reads: bool = False) -> tuple[Counter, Counter]:
    """Ops per step by source, over `steps` greedy steps after 3 warm-up steps, `ids` prefilled in `context`; and
    those of them on host tensors only."""
    with context:
        out = model(ids, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
        with OpsBySource(host_reads) as ops:
            for _ in range(steps):
                token = model(token, cache=cache).logits[:, -1:].argmax(-1)
    return tuple(Counter({k: v / steps for k, v in counts.items()}) for counts in (ops.counts, ops.on_host))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens (default: 4096)")
    parser.add_argument("--presses", default="snapkv,h2o,sentencekv",
                        help="as in `sparsekv bench` (default: %(default)s)")
    parser.add_argument("--ratio", type=float, default=0.1, help="fraction of the prompt's KV kept (default: 0.1)")
    parser.add_argument("--steps", type=int, default=5, help="decoding steps counted (default: 5)")
    parser.add_argument("--lines", type=int, default=12, help="busiest source lines shown per press (default: 12)")
    parser.add_argument("--host-reads", action="store_true", help="count only ops that read a value on the host "
                        "(host-device synchronisations on a GPU)")
    model_arguments(parser)
    args = parser.parse_args(argv)
    model, tokenizer, name = load_from_arguments(args, *model_placement(args))
    ids = needle_prompt(tokenizer, args.length).to(model.device)
    gpu = model.device.type != "cpu"
    oracle, _ = count(model, ids[:, -round(args.ratio * args.length):], contextlib.nullcontext(), args.steps,
                      args.host_reads)
    what = "host reads (GPU synchronisations)" if args.host_reads else "ops dispatched"
    print(f"{name}, {args.length}-token prompt, ratio {args.ratio}: {what} per decoding step"
          + (" (on host tensors: the second column)" if gpu and not args.host_reads else ""))
    print(f"oracle: {sum(oracle.values()):.0f}")
    for spec in split_specs(args.presses):
        ops, on_host = count(model, ids, make_press(spec, ratio=args.ratio, tokenizer=tokenizer)(model), args.steps,
                             args.host_reads)
        total = sum(ops.values())
        host = f", {sum(on_host.values()):.0f} on host tensors" if gpu and not args.host_reads else ""
        print(f"\n{spec}: {total:.0f} ({total - sum(oracle.values()):+.0f} against the oracle{host})")
        for where, n in ops.most_common(args.lines):
            print(f"{n:8.1f}  " + (f"{on_host[where]:8.1f}  " if gpu and not args.host_reads else "") + where)


if __name__ == "__main__":
    main()
