"""Where does a press lose the needle? Per sample: the answer, and the share of (layer, KV head) pairs whose
kept prompt tokens hold the whole value, any of it, and the layers that hold none of it.

Each prompt runs once (`Prefill`); every press compresses that forward, which `cache.prompt_kept()` reads, and
answers greedily from it. For presses that select while decoding (CHESS, SentenceKV) it is what the last
compression step attends, not what each step reads.

    PYTHONPATH=. python benchmarks/needle_kept.py --model smollm2-135m --task prose_code \\
        --presses snapkv,chunkkv --ratio 0.25 --samples 10
"""

from __future__ import annotations

import argparse

import torch
from chess_affinity import value_tokens
from tqdm.auto import tqdm
from transformers import GenerationConfig

from sparsekv import make_press
from sparsekv.evaluation.prompts import encode
from sparsekv.evaluation.scoring import score
from sparsekv.evaluation.tasks import TASKS
from sparsekv.models import load_model
from sparsekv.prefill import Prefill, generate_from
from sparsekv.presses.registry import split_specs
from sparsekv.table import format_table


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="prose_code", choices=list(TASKS))
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--presses", type=split_specs, default=["snapkv", "chunkkv"])
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--samples", type=int, default=10, help="needle depths swept evenly, ends included")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    generation = GenerationConfig(do_sample=False, max_new_tokens=TASKS[args.task].max_new_tokens,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=model.generation_config.eos_token_id)
    presses = {spec: make_press(spec, tokenizer=tokenizer, ratio=args.ratio) for spec in args.presses}
    rows = []
    for i in tqdm(range(args.samples), desc="samples"):
        depth = i / max(args.samples - 1, 1)
        sample = TASKS[args.task].make(tokenizer, args.length, i, depth, None)  # the samples of `sparsekv eval`
        ids = encode(tokenizer, sample).ids
        answer = sample.answers[0]
        first, end = value_tokens(tokenizer, ids, answer)
        prefill = Prefill.run(model, ids)
        for spec, press in presses.items():
            cache = prefill.compress(press)
            out = generate_from(model, press, cache, ids, generation)
            reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            kept = torch.stack([k[0, :, first:end] for k in cache.prompt_kept().values()])  # (layers, heads, value)
            whole, some = kept.all(-1), kept.any(-1)
            none = [i for i, layer in enumerate(some) if not layer.any()]
            rows.append({"depth": depth, "press": spec, "correct": "yes" if score(reply, [answer], "all") else "no",
                         "whole value": float(whole.float().mean()), "any of it": float(some.float().mean()),
                         "layers without it": f"{len(none)} / {len(kept)}", "reply": reply.strip()[:24]})
    print(f"{args.model}, {args.task}, {args.length} tokens, ratio {args.ratio}: share of (layer, KV head) pairs "
          "keeping the needle's value")
    print(format_table(rows, [("depth", "depth", ".2f"), ("press", "press", ""), ("correct", "correct", ""),
                              ("whole value", "whole value", ".2f"), ("any of it", "any of it", ".2f"),
                              ("layers without it", "layers without it", ""), ("reply", "reply", "")]))


if __name__ == "__main__":
    main()
