"""Which of CHESS's selection rules keeps the needle's page? Needles kept out of the samples, per rule.

Each sample's prompt runs once under `CHESSPress` (its page vectors do not depend on the rule); then Algorithm 1
selects at the same budget with each rule: chunks and grids scored by the mean of their pages (eq. 2) or by
their best page (`pooling="max"`), and the `ratio` split evenly over grids, chunks and pages (sparsekv's
`ratio=` shorthand) or spent on pages alone (`ratios=(1, 1, ratio)`: Algorithm 1 without its upper levels).
A needle counts as kept when every page holding its value is attended (selected, sink or window).

    PYTHONPATH=. python benchmarks/chess_rules.py --model qwen2.5-0.5b --task prose_code --ratio 0.1 --samples 20
"""

from __future__ import annotations

import argparse

import torch
from chess_affinity import needle_arguments, swept_samples
from tqdm.auto import tqdm

from sparsekv import CHESSPress
from sparsekv.models import load_model
from sparsekv.table import format_table


def rules(ratio: float, page_size: int) -> dict[str, CHESSPress]:
    """The rules compared, all on pages of `page_size` tokens (the page vectors of one prefill)."""
    return {
        "mean pooling, ratio split evenly (eq. 2)": CHESSPress(ratio=ratio, page_size=page_size, pooling="mean"),
        "max pooling, ratio split evenly": CHESSPress(ratio=ratio, page_size=page_size, pooling="max"),
        "pages only, ratios=(1, 1, ratio)": CHESSPress(ratios=(1.0, 1.0, ratio), page_size=page_size),
        "pages only, page vectors not centred": CHESSPress(ratios=(1.0, 1.0, ratio), page_size=page_size,
                                                           centre=False),
    }


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    needle_arguments(parser, ratio=0.1, samples=20)
    parser.add_argument("--page-size", type=int, default=32, help="tokens per page (default: 32, the paper's)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    presses = rules(args.ratio, args.page_size)
    kept = {name: 0 for name in presses}
    pages = {name: [] for name in presses}
    for _, _, ids, (first, end) in tqdm(swept_samples(tokenizer, args.task, args.length, args.samples),
                                        total=args.samples, desc="samples"):
        first_press = next(iter(presses.values()))
        with first_press(model):
            out = model.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
        lengths = torch.tensor([ids.shape[1]])
        for name, press in presses.items():
            _, _, selected = press.select(out.cache.state.page_sums, lengths)
            always, _ = press.page_roles(lengths, selected.shape[1])
            attended = selected[0] | always[0]
            kept[name] += bool(attended[first // press.page_size: (end - 1) // press.page_size + 1].all())
            pages[name].append(int(selected[0].sum()))
    rows = [{"rule": name, "needles kept": f"{kept[name]} / {args.samples}",
             "pages selected": sum(pages[name]) / len(pages[name])} for name in presses]
    print(f"{args.model}, {args.task}, {args.length} tokens, ratio {args.ratio}, {args.samples} samples")
    print(format_table(rows, [("rule", "rule", ""), ("needles kept", "needles kept", ""),
                              ("pages selected (mean)", "pages selected", ".1f")]))


if __name__ == "__main__":
    main()
