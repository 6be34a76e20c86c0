"""Does CHESS's key-key affinity (eq. 4) find the needle? Rank of the needle's page among the candidate pages.

For needle prompts at several depths, the prompt runs once under `CHESSPress` for each way of building the
page vectors (keys before or after RoPE) and scoring them (centred or eq. 4 as written); the script scores
every candidate page against the anchor as the press does and prints where the page holding the needle's
value ranks (0 = best), and whether the press selected it. With the press's defaults it also says where the
selection lost the needle: its grid or its chunk not kept by Algorithm 1's upper levels, or the value's last
token in the next page (a value cut by a page boundary), and that page's fate.

    PYTHONPATH=. python benchmarks/chess_affinity.py --model smollm2-135m --length 4096 --depths 0.1,0.5,0.9
    PYTHONPATH=. python benchmarks/chess_affinity.py --task niah_multikey --depths 0.1,0.3,0.5,0.7,0.9
    PYTHONPATH=. python benchmarks/chess_affinity.py --model qwen2.5-0.5b --task prose_code --ratio 0.1 \
        --samples 8 --variants press
"""

from __future__ import annotations

import argparse
import bisect
import re

import torch
from tqdm.auto import tqdm

from sparsekv import CHESSPress
from sparsekv.evaluation.prompts import encode
from sparsekv.evaluation.runner import local_samples
from sparsekv.evaluation.tasks import TASKS
from sparsekv.models import load_model
from sparsekv.table import format_table

VARIANTS = [(True, True), (True, False), (False, True), (False, False)]  # (pre_rope, centre); the first: defaults
VALUES = r"is: (\d+)|archive is ([A-Z0-9]{3}-[A-Z0-9]{4})\."  # needle values in niah and prose_multikey prompts


def needle_token(tokenizer, prompt_ids: torch.Tensor, answer: str) -> int:
    """Index of the first token of the needle's value in `prompt_ids` (its first occurrence)."""
    return value_tokens(tokenizer, prompt_ids, answer)[0]


def value_tokens(tokenizer, prompt_ids: torch.Tensor, answer: str) -> tuple[int, int]:
    """`(first, end)`: the tokens `first .. end - 1` of `prompt_ids` spell the value `answer` (first occurrence)."""
    ids = prompt_ids[0].tolist()
    start = tokenizer.decode(ids).index(answer)

    def decoded(i):
        return len(tokenizer.decode(ids[:i]))

    # Bisect: the most tokens whose text ends at or before the value, and the fewest whose text covers it.
    first = bisect.bisect_right(range(len(ids) + 1), start, key=decoded) - 1
    return first, bisect.bisect_left(range(len(ids) + 1), start + len(answer), key=decoded)


def needle_arguments(parser: argparse.ArgumentParser, ratio: float, samples: int) -> None:
    """The options of a per-sample needle benchmark: --model, --task, --length, --ratio, --samples."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="prose_code", choices=list(TASKS))
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--ratio", type=float, default=ratio)
    parser.add_argument("--samples", type=int, default=samples, help="needle depths swept evenly, ends included")


def swept_samples(tokenizer, task: str, length: int, samples: int):
    """The prompts of `sparsekv eval` at `samples` needle depths swept evenly, ends included: for each, its depth,
    the sample, its prompt ids and the value's token span `(first, end)` (`value_tokens`)."""
    for sample in local_samples(task, tokenizer, length, samples, seed=0):
        ids = encode(tokenizer, sample).ids
        yield sample.depth, sample, ids, value_tokens(tokenizer, ids, sample.answers[0])


@torch.no_grad()
def page_scores(model, ids: torch.Tensor, press: CHESSPress):
    """Eq. 4 score of every page after the prompt `ids` (-inf for pages that are not candidates), and the
    grids, chunks and pages Algorithm 1 kept."""
    with press(model):
        out = model.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    state, lengths = out.cache.state, torch.tensor([ids.shape[1]])
    vectors, anchor, candidate = press.page_vectors(state.page_sums, lengths)
    grids, chunks, pages = press.select(state.page_sums, lengths)
    scores = (vectors @ anchor[..., None])[0, :, 0].masked_fill(~candidate[0], float("-inf"))
    return scores, grids[0], chunks[0], pages[0]


def rank(scores: torch.Tensor, page: int) -> int:
    return int((scores > scores[page]).sum())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--preset", default="aggressive")
    budget.add_argument("--ratio", type=float, help="CHESSPress(ratio=...) instead of a preset")
    parser.add_argument("--task", default="niah_single",
                        choices=["niah_single", "niah_multikey", *[t for t in TASKS if t.startswith("prose")]],
                        help="multikey: also the ranks of the three distractor needles' pages")
    parser.add_argument("--pooling", choices=["mean", "max"], default="mean", help="CHESSPress(pooling=...) "
                        "(default: mean, the paper's eq. 2)")
    parser.add_argument("--page-size", type=int, default=32, help="CHESSPress(page_size=...) (default: 32, the "
                                                                   "paper's)")
    parser.add_argument("--samples", type=int, default=1, help="samples (seeds) per depth (default: 1)")
    parser.add_argument("--variants", choices=["all", "press"], default="all",
                        help="all: the four ways of building page vectors; press: the defaults only")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    budget = {"ratio": args.ratio} if args.ratio is not None else {"preset": args.preset}
    budget["pooling"], budget["page_size"], size = args.pooling, args.page_size, args.page_size
    budget["page_stride"] = size  # pages one after the other: a page's rank is the page's, not a block's
    variants = VARIANTS if args.variants == "all" else VARIANTS[:1]
    rows = []
    points = [(float(d), seed) for d in args.depths.split(",") for seed in range(args.samples)]
    for depth, seed in tqdm(points, desc="samples"):
        sample = TASKS[args.task].make(tokenizer, args.length, seed, depth, None)
        ids = encode(tokenizer, sample).ids
        first, end = value_tokens(tokenizer, ids, sample.answers[0])
        page, end_page = first // size, (end - 1) // size
        row = {"depth": depth, "seed": seed, "needle page": page, "pages": -(-ids.shape[1] // size)}
        distractors = [needle_token(tokenizer, ids, v) // size for m in re.findall(VALUES, sample.context)
                       for v in m if v and v != sample.answers[0]]
        for pre_rope, centre in variants:
            press = CHESSPress(**budget, reselect="never", pre_rope=pre_rope, centre=centre)
            scores, grids, chunks, selected = page_scores(model, ids, press)
            label = f"{'pre' if pre_rope else 'post'}-RoPE{', centred' if centre else ''}"
            row[label] = f"{rank(scores, page)}{' (selected)' if selected[page] else ''}"
            if (pre_rope, centre) == VARIANTS[0]:  # the press's defaults: where the selection lost the needle
                per_grid = press.chunk_pages * press.grid_chunks
                row["grid kept"] = "yes" if grids[page // per_grid] else "no"
                row["chunk kept"] = "yes" if chunks[page // press.chunk_pages] else "no"
                row["value ends in"] = "same page" if end_page == page else (
                    f"next ({rank(scores, end_page)}{', selected' if end_page < len(selected) and selected[end_page] else ''})")
                if distractors:
                    row["distractor pages' ranks"] = " ".join(str(rank(scores, d)) for d in distractors)
                    row["best page"] = int(scores.argmax())
        rows.append(row)
    print(f"{args.model}, {args.length} tokens, {args.task}, {budget}: rank of the needle's page (0 = best)")
    print(format_table(rows, [(k, k, ".2f" if k == "depth" else "") for k in rows[0]]))


if __name__ == "__main__":
    main()
