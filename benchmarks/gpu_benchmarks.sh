#!/usr/bin/env bash
# The GPU benchmarks (docs/gpu.md), in order of priority, inside a fixed deadline: compiled decoding first
# (generate's compiled steps against eager for the presses whose steps compile and for the oracle, on the 8B shape
# at 32k tokens, batch 1, then head-wise budgets' KV and eager step, then its tests on CUDA, then batch 8:
# COMPILED_PRESSES, COMPILED_B8_PRESSES); the test
# matrix on CUDA;
# on a Llama-3.1-8B-shaped model (random weights, bf16, sdpa) at 32k tokens, decode steps against the oracle at
# batch 1 with host synchronisations counted, each step's ops by source line, a profile of a step per press (torch
# and cProfile), the steps at batch 8, the largest
# batch each fits in the full cache's batch-1 memory (prefilled together, then a row at a time and joined), the
# prefill's peak with the prompt in pieces,
# `sparsekv bench` rows (prefill, GPU memory, KV bytes);
# then 128k if time is left. Logs go to $OUT (default: gpu-results/); a step short of time is skipped.
# B1_PRESSES, B8_PRESSES, OPS_PRESSES, PROFILE_PRESSES, APART_PRESSES and CHUNKED_PRESSES, when set, replace the
# press lists of decode32k_b1, decode32k_b8, ops32k, profile32k, capacity32k_apart and chunked32k; APART_MAX_BATCH
# the largest batch capacity32k_apart tries (16), APART_EXACT=1 has it bisect past the last power of 2.
#
#   bash benchmarks/gpu_benchmarks.sh TOKENIZER_DIR [SECONDS [STEP...]]   # STEP names pick some; order is fixed
#
# On a machine without sparsekv's requirements, install them first (the wheels of transformers >= 5.24, nltk).
set -u
TOKENIZER=${1:?usage: gpu_benchmarks.sh TOKENIZER_DIR [SECONDS [STEP...]]}
DEADLINE=$(( $(date +%s) + ${2:-540} ))
shift $(( $# < 2 ? $# : 2 ))
# the steps' names only
STEPS=" ${*:-compiled32k_b1 heads32k compiled_tests compiled32k_b8 tests tests_more decode32k_b1 ops32k profile32k decode32k_b8 capacity32k capacity32k_apart chunked32k bench32k decode128k_b1} "
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1

# run NAME CAP COMMAND...: COMMAND under a timeout of CAP seconds or what is left before the deadline
run() {
  local name=$1 cap=$2 left=$(( DEADLINE - $(date +%s) - 5 ))
  shift 2
  [[ $STEPS == *" $name "* ]] || return 0
  (( left < 20 )) && { echo "== $name: skipped, ${left}s left"; return; }
  (( cap > left )) && cap=$left
  echo "== $name (at most ${cap}s): $*"
  local start=$(date +%s)
  timeout "$cap" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $(( $(date +%s) - start ))s"
  tail -n 40 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

# Random prompts (the tokenizer: SentenceKV's sentence ends). Each compiled configuration compiles once (its first
# generation); perf_hints says where CUDA graphs were skipped, and why. SentenceKV's store on the GPU: a compiled
# step loads its whole region from it (docs/compiled.md).
COMPILED=(--shape llama-3.1-8b --tokenizer "$TOKENIZER" --device cuda --dtype bfloat16 --length 32768 --new 20
          --warmup 4 --repeats 2)
TORCH_LOGS=perf_hints run compiled32k_b1 420 python3 -m benchmarks.compiled_decode "${COMPILED[@]}" --batch 1 \
  --presses "${COMPILED_PRESSES:-streamingllm,h2o,snapkv,chunkkv,chess,sentencekv:offload_device=cuda}" \
  --json "$OUT/compiled32k_b1.json"
# Head-wise budgets in lanes against the uniform press: KV held and an eager step (docs/usage.md#head-wise-budgets).
run heads32k 120 python3 -m benchmarks.head_budgets --shape llama-3.1-8b --tokenizer "$TOKENIZER" --device cuda \
  --dtype bfloat16 --length 32768 --ratios 0.25 --presses snapkv,adakv,kvzip --steps 12
run compiled_tests 100 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf --device cuda tests/test_compile.py
# (H2O's prefill of a 32k row takes 11.5 s on an H100: four generations of 8 rows would take the step alone)
TORCH_LOGS=perf_hints run compiled32k_b8 240 python3 -m benchmarks.compiled_decode "${COMPILED[@]}" --batch 8 \
  --presses "${COMPILED_B8_PRESSES:-streamingllm,snapkv,chess}" --json "$OUT/compiled32k_b8.json"

run tests 150 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --device cuda \
  tests/test_devices.py tests/test_core.py tests/test_generate_modes.py tests/test_chess.py \
  tests/test_sentencekv.py tests/test_chunkkv.py tests/test_prefill.py tests/test_errors.py tests/test_registry.py \
  tests/test_join.py

# The files the steps above leave out: the model matrix, the GPU benchmarks' own tests, the pipelines.
run tests_more 240 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --device cuda \
  tests/test_models.py tests/test_gpu_benchmarks.py tests/test_pipeline.py

SHAPE=(--shape llama-3.1-8b --tokenizer "$TOKENIZER" --device cuda --dtype bfloat16)
B1_PRESSES=${B1_PRESSES:-snapkv,streamingllm,chunkkv,h2o,chess,sentencekv,sentencekv:rank_at=layer}
run decode32k_b1 150 python3 -m benchmarks.decode_vs_oracle "${SHAPE[@]}" --length 32768 --batch 1 --steps 16 \
  --repeats 3 --count-syncs --presses "$B1_PRESSES" \
  --json "$OUT/decode32k_b1.json"
# Each step's ops by sparsekv source line, those on the GPU and those on host tensors apart (an offloaded store).
run ops32k 90 python3 -m benchmarks.step_ops "${SHAPE[@]}" --length 32768 --lines 25 \
  --presses "${OPS_PRESSES:-sentencekv,h2o,snapkv}"
run profile32k 90 python3 -m benchmarks.profile_step "${SHAPE[@]}" --length 32768 --steps 8 --top 15 --python 30 --diff \
  --presses "${PROFILE_PRESSES:-snapkv,streamingllm,chunkkv,h2o}"
run decode32k_b8 120 python3 -m benchmarks.decode_vs_oracle "${SHAPE[@]}" --length 32768 --batch 8 --steps 16 \
  --repeats 2 --no-full --presses "${B8_PRESSES:-snapkv,streamingllm,chunkkv}" --json "$OUT/decode32k_b8.json"
# The full cache at batch 1 and 32k took 16.06 GB of weights + 7.8 GB at its peak (docs/gpu.md): 24 GB.
run capacity32k 150 python3 -m benchmarks.random_bench "${SHAPE[@]}" --lengths 32768 --max-new-tokens 8 \
  --presses snapkv,streamingllm,chunkkv,sentencekv --memory-budget 24 --max-batch 16
# The same with each batch prefilled a row at a time and joined: the batch the compressed KV allows.
# (every batch tried is prefilled row by row: 1 + 2 + ... + 16 rows of 32k a press, about 1.8 s each on an H100;
# H2O's prefill, 11.5 s a row, would take the whole step alone)
run capacity32k_apart 300 python3 -m benchmarks.random_bench "${SHAPE[@]}" --lengths 32768 --max-new-tokens 8 \
  --presses "${APART_PRESSES:-snapkv,streamingllm}" --memory-budget 24 --max-batch "${APART_MAX_BATCH:-16}" --rows-apart \
  ${APART_EXACT:+--exact-batch}
# The prefill's peak with the prompt in pieces of 4k (generate's prefill_chunk_size), the same answer checked.
run chunked32k 120 python3 -m benchmarks.chunked_prefill "${SHAPE[@]}" --length 32768 --chunks 0,4096 \
  --presses "${CHUNKED_PRESSES:-snapkv,streamingllm}" --new-tokens 4
run bench32k 100 python3 -m benchmarks.random_bench "${SHAPE[@]}" --lengths 32768 --max-new-tokens 32 \
  --presses snapkv,streamingllm,chunkkv,h2o,chess,sentencekv --json "$OUT/bench32k.json"
run decode128k_b1 120 python3 -m benchmarks.decode_vs_oracle "${SHAPE[@]}" --length 131000 --batch 1 --steps 16 \
  --repeats 2 --presses snapkv,streamingllm --json "$OUT/decode128k_b1.json"
echo "== done, $(( DEADLINE - $(date +%s) ))s before the deadline"
