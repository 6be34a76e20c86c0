"""Does CHESS's key-key affinity (eq. 4) find the needle? Rank of the needle's page among the candidate pages.

For needle prompts at several depths, the prompt runs once under `CHESSPress` for each way of building the
page vectors (keys before or after RoPE) and scoring them (centred or eq. 4 as written); the script scores
every candidate page against the anchor as the press does and prints where the page holding the needle's
number ranks (0 = best), and whether the press selected it.

    PYTHONPATH=. python benchmarks/chess_affinity.py --model smollm2-135m --length 4096 --depths 0.1,0.5,0.9
    PYTHONPATH=. python benchmarks/chess_affinity.py --task niah_multikey --depths 0.1,0.3,0.5,0.7,0.9
"""

from __future__ import annotations

import argparse
import bisect
import re

import torch
from tqdm.auto import tqdm

from sparsekv import CHESSPress
from sparsekv.evaluation.prompts import encode
from sparsekv.evaluation.tasks import TASKS
from sparsekv.models import load_model
from sparsekv.table import format_table

VARIANTS = [(True, True), (True, False), (False, True), (False, False)]  # (pre_rope, centre)


def needle_token(tokenizer, prompt_ids: torch.Tensor, answer: str) -> int:
    """Index of the first token of the needle's number in `prompt_ids` (its first occurrence)."""
    ids = prompt_ids[0].tolist()
    char = tokenizer.decode(ids).index(answer)
    # Bisect: the most tokens whose decoded text ends at or before the number.
    return bisect.bisect_right(range(len(ids) + 1), char, key=lambda i: len(tokenizer.decode(ids[:i]))) - 1


@torch.no_grad()
def page_scores(model, ids: torch.Tensor, press: CHESSPress) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4 score of every page after the prompt `ids` (-inf for pages that are not candidates), and the
    pages the press selected."""
    with press(model):
        out = model.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    state = out.cache.state
    vectors, anchor, candidate = press.page_vectors(state.page_sums, torch.tensor([ids.shape[1]]))
    return (vectors @ anchor[..., None])[0, :, 0].masked_fill(~candidate[0], float("-inf")), state.selected[0]


def rank(scores: torch.Tensor, page: int) -> int:
    return int((scores > scores[page]).sum())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--preset", default="aggressive")
    parser.add_argument("--task", default="niah_single", choices=["niah_single", "niah_multikey"],
                        help="multikey: also the ranks of the three distractor needles' pages")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    rows = []
    for depth in tqdm([float(d) for d in args.depths.split(",")], desc="depths"):
        sample = TASKS[args.task].make(tokenizer, args.length, 0, depth, None)
        ids = encode(tokenizer, sample).ids
        page = needle_token(tokenizer, ids, sample.answers[0]) // 32
        row = {"depth": depth, "needle page": page, "pages": -(-ids.shape[1] // 32)}
        distractors = [needle_token(tokenizer, ids, v) // 32 for v in re.findall(r"is: (\d+)", sample.context)
                       if v != sample.answers[0]]
        for pre_rope, centre in VARIANTS:
            press = CHESSPress(preset=args.preset, reselect="never", pre_rope=pre_rope, centre=centre)
            scores, selected = page_scores(model, ids, press)
            label = f"{'pre' if pre_rope else 'post'}-RoPE{', centred' if centre else ''}"
            row[label] = f"{rank(scores, page)}{' (selected)' if selected[page] else ''}"
            if distractors and pre_rope and centre:  # the press's defaults
                row["distractor pages' ranks"] = " ".join(str(rank(scores, d)) for d in distractors)
                row["best page"] = int(scores.argmax())
        rows.append(row)
    print(f"{args.model}, {args.length} tokens, preset {args.preset}: rank of the needle's page (0 = best)")
    print(format_table(rows, [(k, k, ".2f" if k == "depth" else "") for k in rows[0]]))


if __name__ == "__main__":
    main()
