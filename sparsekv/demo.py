"""A one-command demo: one needle-in-a-haystack prompt, the full cache against each press.

    python -m sparsekv demo --tokens 2000 --ratio 0.1
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from .cache import cache_footprint
from .niah import build_needle_prompt, score_answer
from .presses.registry import BUILT_IN, make_press
from .table import format_table


class StepClock(LogitsProcessor):
    """Records `time.perf_counter()` each time generate scores a next token, i.e. after every forward
    (on a GPU, once the forward is done)."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)
        self.stamps.append(time.perf_counter())
        return scores


def timed_generate(model, input_ids: torch.Tensor, max_new_tokens: int, **kwargs):
    """Greedy `generate`; returns `(output, seconds, step stamps)`, stamps relative to the start. The attention
    mask defaults to every token (give `attention_mask=` for a left-padded batch)."""
    clock = StepClock()
    mask = kwargs.pop("attention_mask", None)
    start = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids) if mask is None else mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        logits_processor=LogitsProcessorList([clock]),
        **kwargs,
    )
    return out, time.perf_counter() - start, [t - start for t in clock.stamps]


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

    Prefill time is that of a 1-token generation. Decode ms/token is the rest of the full generation over the
    tokens after the first: `(total - first token) / (generated - 1)`, with the first token's time taken in
    the same run (a separate run's prefill, noisier than a few decoding steps, can make it negative).
    `dtype`, `attn_implementation` and `device_map` (a device, or an accelerate map) are `load_model`'s.
    """
    from .models import load_model

    model, tokenizer = load_model(model_name, dtype=dtype, attn_implementation=attn_implementation,
                                  device_map=device_map)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and n_tokens + max_new_tokens > limit:
        raise ValueError(f"n_tokens + max_new_tokens = {n_tokens + max_new_tokens} exceeds the context ({limit})")
    input_ids, answer = build_needle_prompt(tokenizer, n_tokens, depth=depth)
    input_ids = input_ids.to(model.device)
    n_prompt = input_ids.shape[1]
    print(f"model {model_name}: {n_prompt}-token prompt, needle at depth {depth:.0%}, answer {answer}, ratio {ratio}")

    configs = [("full cache", None)] + [(cls.label(), make_press(name, tokenizer=tokenizer, ratio=ratio))
                                        for name, cls in BUILT_IN.items()]
    rows = []
    for name, press in tqdm(configs, desc="presses"):

        def generate(n):
            if press is None:
                return timed_generate(model, input_ids, n)
            with press(model):
                return timed_generate(model, input_ids, n)

        try:
            _, prefill, _ = generate(1)
        except ValueError as err:  # a press that cannot work at this budget says why
            tqdm.write(f"{name}: skipped: {err}")
            rows.append({"press": name, "answer": "(skipped)", "correct": "-", "resident": None, "attended": None,
                         "kv_mb": None, "prefill_s": None, "decode_ms": None})
            continue
        out, total, stamps = generate(max_new_tokens)
        new_tokens = out.sequences.shape[1] - n_prompt
        text = " ".join(tokenizer.decode(out.sequences[0, n_prompt:], skip_special_tokens=True).split())
        resident, attended, kv_bytes = cache_footprint(out.cache)
        rows.append({
            "press": name,
            "answer": text if len(text) <= 30 else text[:27] + "...",
            "correct": "yes" if score_answer(text, answer) else "no",
            "resident": resident,
            "attended": attended,
            "kv_mb": kv_bytes / 2**20,
            "prefill_s": prefill,
            "decode_ms": 1000 * (total - stamps[0]) / (new_tokens - 1) if new_tokens > 1 else None,
        })
    columns = [
        ("press", "press", ""), ("answer", "answer", ""), ("correct", "correct", ""),
        ("resident KV tokens", "resident", ".0f"), ("attended", "attended", ".0f"), ("KV MB", "kv_mb", ".2f"),
        ("prefill s", "prefill_s", ".2f"), ("decode ms/token", "decode_ms", ".1f"),
    ]
    print(format_table(rows, columns))
    return rows
