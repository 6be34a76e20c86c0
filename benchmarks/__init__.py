"""sparsekv's maintained benchmarks, each tested (tests/test_gpu_benchmarks.py), run as modules from the repository
root: `python -m benchmarks.decode_vs_oracle --help`. Their results and commands: docs/results.md, docs/gpu.md."""
