"""A one-command demo: one needle-in-a-haystack prompt, the full cache against the library's methods and
baselines (kvpress's simple scorers are in `sparsekv eval`: `--presses knorm,keydiff,tova`).

    sparsekv demo --tokens 2000 --ratio 0.1

The prompt is read once (`Prefill`): every press compresses that same forward, as it would inside `generate`,
and continues it greedily, so the demo costs one prefill and a few short decodes.
"""

from __future__ import annotations

import copy
import time

import torch

from .niah import build_needle_prompt, score_answer
from .prefill import Prefill
from .presses.registry import BUILT_IN, make_press
from .stats import cache_footprint
from .table import format_table

# The methods (ChunkKV, SentenceKV, CHESS) and their baselines, in the README's order.
DEMO_PRESSES = ("snapkv", "h2o", "streamingllm", "chunkkv", "sentencekv", "chess")
COLUMNS = [
    ("press", "press", ""), ("answer", "answer", ""), ("correct", "correct", ""),
    ("KV held", "resident", ".0f"), ("read per step", "attended", ".0f"), ("KV MB", "kv_mb", ".2f"),
    ("press ms", "press_ms", ".0f"), ("decode ms/token", "decode_ms", ".1f"),
]
LEGEND = """\
KV held: tokens of keys and values a layer holds per sequence at the end (prompt and generated), mean over layers.
read per step: of those, the tokens a decoding step attends. KV MB: the keys and values held, every layer.
press ms: the press's work on the prompt (scoring and selecting; the prefill itself is shared, timed above).
decode ms/token: the decoding steps after the first token, per token.
H2O and StreamingLLM are expected to miss at 10%: H2O keeps the tokens the whole prompt attended to most, and one
needle sentence among thousands is not among them; StreamingLLM keeps the prompt's first and last tokens. The
others rank tokens by what the question at the end attends to, and keep the needle.
CHESS evicts nothing: it holds every token and reads, at each step, the pages that match the recent context, so
its KV held is the full cache's, its read per step is about the ratio's, and its KV MB is a little more than the
full cache's (room for the tokens to come, and a copy of the pages a step reads)."""


def run_demo(
    model_name: str = "smollm2-135m",
    n_tokens: int = 2000,
    ratio: float = 0.1,
    max_new_tokens: int = 16,
    depth: float = 0.5,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device_map=None,
) -> list[dict]:
    """Answer one needle question with the full cache and with each press at `ratio`; print and return a table.

    Args:
        model_name: an offline model's alias (`sparsekv.models.MODELS`), a .gguf file or a model folder.
        n_tokens: prompt length in tokens (chat template included).
        ratio: fraction of the prompt's KV each press keeps (CHESS: of its pages it reads).
        max_new_tokens: tokens generated per answer.
        depth: where the needle sits, 0 (start) to 1 (end).
        dtype, attn_implementation, device_map: as `sparsekv.models.load_model` takes them.
    """
    from .models import load_model

    model, tokenizer = load_model(model_name, dtype=dtype, attn_implementation=attn_implementation,
                                  device_map=device_map)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and n_tokens + max_new_tokens > limit:
        raise ValueError(f"n_tokens + max_new_tokens = {n_tokens + max_new_tokens} exceeds the context ({limit})")
    input_ids, answer = build_needle_prompt(tokenizer, n_tokens, depth=depth)
    input_ids = input_ids.to(model.device)
    start = time.perf_counter()
    prefill = Prefill.run(model, input_ids)
    print(f"model {model_name}: {input_ids.shape[1]}-token prompt, needle at depth {depth:.0%}, answer {answer}, "
          f"ratio {ratio}; prefill (shared by every press) {time.perf_counter() - start:.1f} s")
    configs = [("full cache", None)] + [(BUILT_IN[name].label(), make_press(name, tokenizer=tokenizer, ratio=ratio))
                                        for name in DEMO_PRESSES]
    rows = []
    for name, press in configs:
        start = time.perf_counter()
        cache = copy.deepcopy(prefill.cache) if press is None else prefill.compress(press)
        press_s = time.perf_counter() - start
        start = time.perf_counter()
        ids = prefill.generate(press, cache=cache, max_new_tokens=max_new_tokens)
        decode_s = time.perf_counter() - start
        new = ids[0, input_ids.shape[1]:]
        text = " ".join(tokenizer.decode(new, skip_special_tokens=True).split())
        resident, attended, kv_bytes = cache_footprint(cache)
        rows.append({
            "press": name,
            "answer": text if len(text) <= 30 else text[:27] + "...",
            "correct": "yes" if score_answer(text, answer) else "no",
            "resident": resident, "attended": attended, "kv_mb": kv_bytes / 2**20,
            "press_ms": None if press is None else 1000 * press_s,
            "decode_ms": 1000 * decode_s / (len(new) - 1) if len(new) > 1 else None,  # the first is the prefill's
        })
        print(f"  {name}: {text!r}", flush=True)
    print(format_table(rows, COLUMNS))
    print(LEGEND)
    return rows
