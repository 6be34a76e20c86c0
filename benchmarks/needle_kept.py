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
from chess_affinity import needle_arguments, swept_samples
from tqdm.auto import tqdm
from transformers import GenerationConfig

from sparsekv import make_press
from sparsekv.evaluation.scoring import score
from sparsekv.evaluation.tasks import TASKS
from sparsekv.models import load_model
from sparsekv.prefill import Prefill, generate_from
from sparsekv.presses.registry import split_specs
from sparsekv.table import format_table


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    needle_arguments(parser, ratio=0.25, samples=10)
    parser.add_argument("--presses", type=split_specs, default=["snapkv", "chunkkv"])
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    generation = GenerationConfig(do_sample=False, max_new_tokens=TASKS[args.task].max_new_tokens,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=model.generation_config.eos_token_id)
    presses = {spec: make_press(spec, tokenizer=tokenizer, ratio=args.ratio) for spec in args.presses}
    rows = []
    for depth, sample, ids, (first, end) in tqdm(swept_samples(tokenizer, args.task, args.length, args.samples),
                                                 total=args.samples, desc="samples"):
        answer = sample.answers[0]
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
