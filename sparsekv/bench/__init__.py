"""`sparsekv bench`'s measuring: what each press costs at prefill and saves at decoding, against two references.

For every prompt length L, greedy generations of exactly `max_new_tokens` tokens are timed with:

- the full cache on the L-token prompt ("full");
- each press keeping `ratio` of the prompt (or `budget` tokens);
- the *oracle* of that press: the full cache on a prompt as long as the press's budget (`round(ratio * L)` or
  `budget` tokens), i.e. what a perfect press keeping that many tokens would cost.

Prompts are suffixes of one needle-in-a-haystack prompt (`sparsekv.niah`), so every length is exact and the
question stays at the end. A logits processor stamps the time after every forward (`StepClock`):
prefill is the time to the first stamp, the decode latencies are the deltas between stamps. Each configuration
is warmed up once on a short prompt, the repeats are interleaved across configurations (so drift in machine
load hits all of them alike), and medians are reported. Peak memory is the process's resident set size above
its level before the run, sampled by a background thread (`ru_maxrss` only ever grows over a process's life,
so it cannot tell configurations apart), plus `torch.cuda.max_memory_allocated` on a GPU. KV tokens and bytes
are those of the cache at the end of the generation (`SparseCache.stats()`).
"""

from .timing import PeakRSS, StepClock, measure, medians, running_median, slope_per_1k, step_latencies, timed_generate
from .report import format_capacity, format_rows, plot_latency, plot_throughput, summarize
from .run import run_bench, run_capacity
from .settings import Setting, batch_inputs, check_inputs, sweep

__all__ = ["PeakRSS", "Setting", "StepClock", "batch_inputs", "check_inputs", "format_capacity", "format_rows",
           "measure", "medians", "plot_latency", "plot_throughput", "run_bench", "run_capacity",
           "running_median", "slope_per_1k", "step_latencies", "summarize", "sweep", "timed_generate"]
