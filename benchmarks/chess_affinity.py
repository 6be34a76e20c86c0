"""Does CHESS's key-key affinity (eq. 4) find the needle? Rank of the needle's page among the candidate pages.

For needle prompts at several depths, the prompt runs once under `CHESSPress` for each way of building the
page vectors (keys before or after RoPE) and scoring them (centred or eq. 4 as written); the script scores
every candidate page against the anchor as the press does and prints where the page holding the needle's
number ranks (0 = best), and whether the press selected it.

    PYTHONPATH=. python benchmarks/chess_affinity.py --model smollm2-135m --length 4096 --depths 0.1,0.5,0.9
"""

from __future__ import annotations

import argparse
import bisect

import torch
from tqdm.auto import tqdm

from sparsekv import CHESSPress
from sparsekv.evaluation.prompts import encode
from sparsekv.evaluation.tasks import niah_single
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
def needle_rank(model, ids: torch.Tensor, page: int, press: CHESSPress) -> tuple[int, bool]:
    """Rank of page `page` among the candidates after the prompt `ids`, and whether the press selected it."""
    with press(model):
        out = model.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    state = out.past_key_values.state
    vectors, anchor, candidate = press.page_vectors(state.page_sums, torch.tensor([ids.shape[1]]))
    scores = (vectors @ anchor[..., None])[0, :, 0].masked_fill(~candidate[0], float("-inf"))  # eq. 4
    return int((scores > scores[page]).sum()), bool(state.selected[0, page])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--preset", default="aggressive")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    rows = []
    for depth in tqdm([float(d) for d in args.depths.split(",")], desc="depths"):
        sample = niah_single(tokenizer, args.length, seed=0, depth=depth)
        ids = encode(tokenizer, sample).ids
        row = {"depth": depth, "needle page": needle_token(tokenizer, ids, sample.answers[0]) // 32,
               "pages": -(-ids.shape[1] // 32)}
        for pre_rope, centre in VARIANTS:
            press = CHESSPress(preset=args.preset, reselect="never", pre_rope=pre_rope, centre=centre)
            rank, selected = needle_rank(model, ids, row["needle page"], press)
            label = f"{'pre' if pre_rope else 'post'}-RoPE{', centred' if centre else ''}"
            row[label] = f"{rank}{' (selected)' if selected else ''}"
        rows.append(row)
    print(f"{args.model}, {args.length} tokens, preset {args.preset}: rank of the needle's page (0 = best)")
    print(format_table(rows, [(k, k, ".2f" if k == "depth" else "") for k in rows[0]]))


if __name__ == "__main__":
    main()
