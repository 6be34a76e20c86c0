"""Does SentenceKV's store hold the needle's value? Per layer, its tokens in the store and loaded at step 1.

For needle prompts (the samples of `sparsekv eval --tasks niah_single`, `niah_multikey` or a prose task, by
index), the prompt runs under `SentencePress` for one decoding step; the script prints, per layer, how many of
the asked value's tokens the prefilter kept in the offload store, how many the first step loaded on each KV
head, and where that step ranked the needle's sentence on each head. A token missing from a layer's store can never
be attended there, whatever the retrieval does; a stored needle ranked low is the retrieval's miss (compare
`--no-centre`).

    PYTHONPATH=. python benchmarks/sentence_store.py --model smollm2-135m --budget 128 --keep-factor 3 --samples 5,9
    PYTHONPATH=. python benchmarks/sentence_store.py --task niah_multikey --keep-factor 3 --samples 2 --no-centre
    PYTHONPATH=. python benchmarks/sentence_store.py --model qwen2.5-0.5b --task prose_code --ratio 0.1 \\
        --samples 12,14 --kernel-size 7 --max-sentence-tokens 128 --sentence-vector mean
"""

from __future__ import annotations

import argparse

import torch
from chess_affinity import value_tokens
from tqdm.auto import tqdm

from sparsekv import SentencePress
from sparsekv.evaluation.prompts import encode
from sparsekv.evaluation.tasks import TASKS
from sparsekv.models import load_model
from sparsekv.table import format_table


@torch.no_grad()
def value_coverage(model, tokenizer, ids: torch.Tensor, value: range, press: SentencePress):
    """`(answer, rows)`: the first generated tokens, and per layer the value's tokens stored and loaded."""
    with press(model):
        answer = tokenizer.decode(model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:])
        out = model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)  # one step
    wanted = torch.tensor(list(value))
    rows = []
    for i, layer in enumerate(out.cache.layers):
        if getattr(layer, "store_positions", None) is None:
            continue
        stored = torch.isin(wanted, layer.store_positions[0].cpu()).sum()
        loaded = [int(torch.isin(wanted, heads[: layer.state.loaded].cpu()).sum()) for heads in layer.positions[0]]
        rows.append({"layer": i, "stored": f"{int(stored)}/{len(value)}",
                     "loaded per head": " ".join(map(str, loaded)),
                     "sentence rank per head": " ".join(map(str, sentence_ranks(layer, wanted)))})
    return answer, rows


def sentence_ranks(layer, wanted: torch.Tensor) -> list[str]:
    """Per KV head, the rank (0 = best) of the needle's sentence among the stored sentences, as the first
    step scored them; "-" when the store holds none of the value's tokens."""
    hit = torch.isin(layer.store_positions[0].cpu(), wanted).nonzero()
    if len(hit) == 0:
        return ["-"] * layer.keys.shape[1]
    needle = int(layer.state.slot_sentence[0, 0, hit[0, 0]])
    scores = SentencePress.similarity(layer.state)[0]  # (h, S), as the press ranks them
    scores = scores.masked_fill(layer.state.sentence_sizes[0] == 0, float("-inf"))  # empty sentences take no budget
    return [str(int((row > row[needle]).sum())) for row in scores]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    kept = parser.add_mutually_exclusive_group()
    kept.add_argument("--budget", type=int, default=128, help="tau, tokens attended per step (default: 128)")
    kept.add_argument("--ratio", type=float, help="tau as a fraction of the prompt, instead of --budget")
    parser.add_argument("--task", default="niah_single",
                        choices=[t for t in TASKS if t.startswith(("niah_single", "niah_multikey", "prose_"))],
                        help="the asked needle is the one traced (multikey: three distractors besides)")
    parser.add_argument("--kernel-size", type=int, default=SentencePress.kernel_size,
                        help="SnapKV's pooling kernel of the prefilter (default: SentencePress's, %(default)s)")
    parser.add_argument("--keep-factor", type=float, default=2.0, help="r: r * tau tokens kept in the store")
    parser.add_argument("--no-centre", dest="centre", action="store_false", help="eq. 1 on the cached keys")
    parser.add_argument("--sentence-vector", choices=("mean", "bounds"), default=SentencePress.sentence_vector,
                        help="what stands for a sentence (default: SentencePress's, %(default)s; mean: eq. 1)")
    parser.add_argument("--max-sentence-tokens", type=int, default=SentencePress.max_sentence_tokens,
                        help="longest sentence, in tokens (default: SentencePress's, %(default)s)")
    parser.add_argument("--no-prompt-sentence", dest="prompt_sentence", action="store_false",
                        help="start the mean query empty (the paper's Fig. 2)")
    parser.add_argument("--samples", default="5,9", help="sample indices, as `sparsekv eval --samples 20` numbers them")
    parser.add_argument("--of", type=int, default=20, help="samples in the sweep (sets each index's needle depth)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    for index in tqdm([int(i) for i in args.samples.split(",")], desc="samples"):
        sample = TASKS[args.task].make(tokenizer, args.length, index, index / (args.of - 1), None)
        ids = encode(tokenizer, sample).ids
        value = sample.answers[0]
        start, end = value_tokens(tokenizer, ids, value)
        kept = {"ratio": args.ratio} if args.ratio is not None else {"budget": args.budget}
        press = SentencePress(tokenizer, **kept, keep_factor=args.keep_factor, centre=args.centre,
                              prompt_sentence=args.prompt_sentence, kernel_size=args.kernel_size,
                              sentence_vector=args.sentence_vector, max_sentence_tokens=args.max_sentence_tokens,
                              plan="layer")  # each layer keeps its own ranking state, read here
        answer, rows = value_coverage(model, tokenizer, ids, range(start, end), press)
        print(f"\nsample {index}: value {value} at tokens {start}-{end - 1}; answer {answer!r}")
        print(format_table(rows, [(k, k, "") for k in rows[0]]))


if __name__ == "__main__":
    main()
