"""Does CHESS's key-key affinity (eq. 4) find the needle? Rank of the needle's page among the candidate pages.

For needle prompts at several depths, the prompt runs once under `CHESSPress`; the script then scores every
candidate page against the anchor as the press does (eq. 1-4) and prints where the page holding the needle's
number ranks (0 = best), next to the number of pages a preset selects. Also shown, for comparison only (not
what the press does): the rank with page vectors and anchor centred on the mean candidate page.

    PYTHONPATH=. python benchmarks/chess_affinity.py --model smollm2-135m --length 4096 --depths 0.1,0.5,0.9
"""

from __future__ import annotations

import argparse
import bisect

import torch

from sparsekv import CHESSPress
from sparsekv.evaluation.prompts import encode
from sparsekv.evaluation.tasks import niah_single
from sparsekv.models import load_model
from sparsekv.presses.chess import masked_mean
from sparsekv.table import format_table


def needle_token(tokenizer, prompt_ids: torch.Tensor, answer: str) -> int:
    """Index of the first token of the needle's number in `prompt_ids` (its first occurrence)."""
    text = tokenizer.decode(prompt_ids[0])
    char = text.index(answer)
    ids = prompt_ids[0].tolist()
    # Bisect: the most tokens whose decoded text ends at or before the number.
    return bisect.bisect_right(range(len(ids) + 1), char, key=lambda i: len(tokenizer.decode(ids[:i]))) - 1


@torch.no_grad()
def needle_rank(model, tokenizer, press: CHESSPress, length: int, depth: float, seed: int = 0) -> dict:
    sample = niah_single(tokenizer, length, seed=seed, depth=depth)
    ids = encode(tokenizer, sample).ids
    with press(model):
        out = model.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    state, n = out.past_key_values.state, ids.shape[1]
    lengths = torch.tensor([n])
    n_pages = -(-n // press.page_size)
    counts = (lengths[:, None] - torch.arange(n_pages) * press.page_size).clamp(1, press.page_size)
    vectors = (state.page_sums[:, :n_pages] / counts[..., None])[0]
    always, candidate = press.page_roles(lengths, n_pages)
    window = (always & (torch.arange(n_pages) >= press.sink_pages))[0]
    anchor, candidate = vectors[window].mean(0), candidate[0]
    page = needle_token(tokenizer, ids, sample.answers[0]) // press.page_size
    centre = masked_mean(vectors[None], candidate[None], dim=1)[0]

    def rank(scores):
        return int((scores.masked_fill(~candidate, float("-inf")) > scores[page]).sum())

    return {"depth": depth, "page": page, "candidates": int(candidate.sum()),
            "selected": int(state.selected[0].sum()), "needle selected": str(bool(state.selected[0, page])),
            "rank eq. 4": rank(vectors @ anchor), "rank centred": rank((vectors - centre) @ (anchor - centre))}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--preset", default="aggressive")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    press = CHESSPress(preset=args.preset, reselect="never")
    rows = [needle_rank(model, tokenizer, press, args.length, float(d)) for d in args.depths.split(",")]
    columns = [(k, k, ".2f" if k == "depth" else "") for k in rows[0]]
    print(f"{args.model}, {args.length} tokens, {press!r}")
    print(format_table(rows, columns))


if __name__ == "__main__":
    main()
