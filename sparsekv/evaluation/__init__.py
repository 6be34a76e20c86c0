"""`sparsekv eval` and `sparsekv report`: RULER-style long-context tasks, swept over presses and budgets.

- `tasks`: the synthetic task generators, `prompts`: samples as chat-template tokens, `scoring`: RULER's metrics.
- `presses`: presses by name (the registry's, and "full"), `runner`: the sweep (resumable, split over
  accelerate processes), `results`: a run's files (config, prediction shards, merged predictions, metrics).
- `report`: table and plot of a results folder, `hub`: optional RULER / LongBench data from the Hub.
"""

from .presses import known_presses, make_press
from .prompts import Prompt, Sample, encode
from .report import format_report, load_results, plot
from .runner import EvalConfig, Evaluator, Run, load_and_evaluate
from .scoring import score
from .tasks import TASKS

__all__ = ["TASKS", "EvalConfig", "Evaluator", "Prompt", "Run", "Sample", "encode", "format_report",
           "known_presses", "load_and_evaluate", "load_results", "make_press", "plot", "score"]
