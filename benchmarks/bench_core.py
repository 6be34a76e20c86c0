"""Core benchmark: now `sparsekv bench` (see `sparsekv/bench.py`); this script forwards its arguments to it.

    PYTHONPATH=. python benchmarks/bench_core.py --lengths 8000 --ratios 0.1 --repeats 3 --plot latency.png
"""

from __future__ import annotations

import sys

from sparsekv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
