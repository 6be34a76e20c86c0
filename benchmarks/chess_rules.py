"""Which of CHESS's selection rules keeps the needle's page? Needles kept out of the samples, per rule.

Each sample's prompt runs once under `CHESSPress` (its page vectors do not depend on the rule); then Algorithm 1
selects at the same budget with each rule: chunks and grids scored by the mean of their pages (eq. 2) or by
their best page (`pooling="max"`), and the `ratio` split evenly over grids, chunks and pages (sparsekv's
`ratio=` shorthand) or spent on pages alone (`ratios=(1, 1, ratio)`: Algorithm 1 without its upper levels).
A needle counts as kept when every page holding its value is attended (selected, sink or window). One more rule,
`--bounds`, replaces eq. 4's page vector by Quest's page bound: each page's channel-wise max and min of its
centred keys before RoPE (over every layer and KV head, as eq. 1), scored `sum_i max(a_i max_i, a_i min_i)`
against the anchor `a`, with max pooling; its keys come from the cache's store, so it is traced here only. With
`--bounds` also: eq. 4's score and the bound, each standardised over the row's candidate pages, summed.
`--queries` keeps eq. 1's page vectors and changes eq. 3's anchor: instead of the mean key of the recent pages,
the mean query of the prompt's last 32 tokens, before RoPE as the page vectors are (a question at the end is
what those queries look for; beyond the paper, traced here only).
`--per-layer` keeps eq. 1's page vectors and eq. 3's anchor and changes how eq. 4 sums them: each compressed
layer's share of the product (or each layer and KV head's, the second rule) standardised over the row's candidate
pages, then summed, so that every layer (head) votes alike instead of the layers whose keys are largest.
`--tokens` scores a page by its best token: the largest product of one of its tokens' centred keys before RoPE with
the anchor (eq. 4 is their mean, the bound their upper bound), with max pooling; and that score plus eq. 4's, each
standardised over the row's candidate pages, or each page's ranks by the two summed.
`--page-stride N` adds overlapping pages (`CHESSPress(page_stride=N)`: a page of `--page-size` tokens starts every N
tokens, and attention reads the blocks of N tokens of the selected ones; sparsekv's, built into the press).
`--answers` generates instead, greedily as `sparsekv eval` does on the same prompts, with the default CHESS and
with CHESS selecting by the means + bounds rule (or, with `--tokens`, the best token) at every selection
(`TracedRule`), and scores the answers.

    PYTHONPATH=. python benchmarks/chess_rules.py --model qwen2.5-0.5b --task prose_code --ratio 0.1 --samples 20
    PYTHONPATH=. python benchmarks/chess_rules.py --model smollm2-135m --task prose_code --page-size 16 --bounds
    PYTHONPATH=. python benchmarks/chess_rules.py --model qwen2.5-0.5b --task prose_code --page-size 16 --answers
    PYTHONPATH=. python benchmarks/chess_rules.py --model smollm2-135m --task prose_code --page-size 16 --page-stride 8
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import Any

import torch
from chess_affinity import needle_arguments, swept_samples
from tqdm.auto import tqdm

from sparsekv import CHESSPress
from sparsekv.attention import query_projection, rotate
from sparsekv.evaluation.scoring import score
from sparsekv.evaluation.tasks import TASKS
from sparsekv.architectures import attention_modules
from sparsekv.models import load_model
from sparsekv.presses.chess import masked_mean
from sparsekv.table import format_table


def flat_pages(page_size: int, pooling: str = "max") -> dict:
    """CHESSPress options of pages of `page_size` tokens one after the other, the grid every traced rule scores."""
    return {"page_size": page_size, "page_stride": page_size, "pooling": pooling}


def rules(ratio: float, page_size: int) -> dict[str, CHESSPress]:
    """The rules compared, all on pages of `page_size` tokens one after the other (the page vectors of one
    prefill)."""
    return {
        "mean pooling, ratio split evenly (eq. 2)": CHESSPress(ratio=ratio, **flat_pages(page_size, "mean")),
        "max pooling, ratio split evenly": CHESSPress(ratio=ratio, **flat_pages(page_size)),
        "pages only, ratios=(1, 1, ratio)": CHESSPress(ratios=(1.0, 1.0, ratio), **flat_pages(page_size)),
        "pages only, page vectors not centred": CHESSPress(ratios=(1.0, 1.0, ratio), centre=False,
                                                           **flat_pages(page_size)),
    }


def regrouped(sums: torch.Tensor, stride: int, press: CHESSPress) -> torch.Tensor:
    """Page sums `(batch, blocks, D)` kept per `stride` tokens, summed into `press`'s blocks (a multiple)."""
    factor = press.page_stride // stride
    b, n, d = sums.shape
    sums = torch.nn.functional.pad(sums, (0, 0, 0, -n % factor))
    return sums.view(b, -1, factor, d).sum(2)


def centred_pages(model, cache, press: CHESSPress, n: int, sums: torch.Tensor | None = None):
    """The prompt's keys before RoPE, centred as `page_vectors` centres page vectors, cut into pages
    `(pages, page_size, D)` (NaN past the prompt's last token), with the anchor `(D,)` and the candidate pages
    `(1, pages)` (one row, `n` prompt tokens; its keys come from the cache's store; `sums`: the page sums in the
    press's blocks, when the cache's are not)."""
    device = cache.layers[cache.state.columns[0]].store_keys.device
    cos, sin = model.model.rotary_emb(torch.zeros(1, n, 1, device=device), torch.arange(n, device=device)[None])
    keys = torch.cat([rotate(cache.layers[i].store_keys[:, :, :n].float(), (cos, sin), inverse=True)
                      .permute(0, 2, 1, 3).flatten(2) for i in cache.state.columns], dim=-1)[0]  # (n, D)
    lengths = torch.tensor([n], device=device)
    sums = cache.state.page_sums if sums is None else sums
    _, anchor, candidate = press.page_vectors(sums, lengths)
    plain, _, _ = dataclasses.replace(press, centre=False).page_vectors(sums, lengths)
    keys = keys - masked_mean(plain, candidate, dim=1)[0]  # the centre `page_vectors` subtracted
    n_pages = plain.shape[1]
    pad = n_pages * press.page_size - n
    pages = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("nan")).view(n_pages, press.page_size, -1)
    return pages, anchor[0], candidate


def bound_scores(model, cache, press: CHESSPress, n: int, sums=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each page's bound `(1, pages)` against the anchor, `sum_i max(a_i max_i, a_i min_i)` over the channels of
    its tokens' centred keys before RoPE (`centred_pages`), and the candidate pages `(1, pages)`."""
    pages, anchor, candidate = centred_pages(model, cache, press, n, sums)
    high = pages.nan_to_num(float("-inf")).amax(1)
    low = pages.nan_to_num(float("inf")).amin(1)
    return (high @ anchor.clamp(min=0) + low @ anchor.clamp(max=0))[None], candidate


def token_scores(model, cache, press: CHESSPress, n: int, sums=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each page's best token `(1, pages)`: the largest product of one of its tokens' centred keys before RoPE
    (`centred_pages`) with the anchor (the bound is this score's upper bound, eq. 4 its mean), and the candidate
    pages `(1, pages)`."""
    pages, anchor, candidate = centred_pages(model, cache, press, n, sums)
    return (pages @ anchor).nan_to_num(float("-inf")).amax(1)[None], candidate


@dataclasses.dataclass(kw_only=True)
class TracedRule(CHESSPress):
    """CHESS selecting by a traced rule at every selection, to measure its answers: `"bounds"`, eq. 4's score plus
    the page bound, each standardised over the row's candidate pages (the `--bounds` rule), or `"tokens"`, each
    page's best token (the `--tokens` rule). A trace, not a press: one row, one generation at a time, the keys
    read from the store at each selection (`centred_pages`), the model held here."""

    model: Any = dataclasses.field(default=None, repr=False)
    rule: str = "bounds"

    def end_forward(self, cache, logits):
        self._cache = cache  # (the trace's one generation: `select` reads its store)
        super().end_forward(cache, logits)

    def select(self, page_sums, lengths):
        n = int(lengths[0])
        if self.rule == "tokens":
            return self.select_by(*token_scores(self.model, self._cache, self, n))
        vectors, anchor, candidate = self.page_vectors(page_sums, lengths)
        bound, _ = bound_scores(self.model, self._cache, self, n)
        mean = (vectors @ anchor[:, :, None])[..., 0]
        return self.select_by(standardised(mean, candidate) + standardised(bound, candidate), candidate)


def answers(model, tokenizer, args) -> None:
    """Greedy answers of the default CHESS and of the traced rules (`TracedRule`: `--bounds`, `--tokens`; the
    bounds rule when neither is given) on the swept prompts, scored as `sparsekv eval` scores them."""
    task = TASKS[args.task]
    pages = flat_pages(args.page_size)
    presses = {"page means (the default)": CHESSPress(ratio=args.ratio, **pages)}
    if args.bounds or not args.tokens:
        presses["page means + page bounds, standardised"] = TracedRule(
            ratio=args.ratio, **pages, model=model, rule="bounds")
    if args.tokens:
        presses["page's best token"] = TracedRule(ratio=args.ratio, **pages,
                                                  model=model, rule="tokens")
    scores = {name: [] for name in presses}
    replies = {name: [] for name in presses}
    for _, sample, ids, _ in tqdm(swept_samples(tokenizer, args.task, args.length, args.samples),
                                  total=args.samples, desc="samples"):
        for name, press in presses.items():
            with press(model):
                out = model.generate(ids, max_new_tokens=task.max_new_tokens, do_sample=False)
            reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            scores[name].append(score(reply, sample.answers, sample.metric))
            replies[name].append(f"{sample.answers[0]} -> {reply.strip()[:30]!r}")
    print(f"{args.model}, {args.task}, {args.length} tokens, ratio {args.ratio}, {args.samples} samples: answers")
    rows = [{"rule": name, "score": 100 * sum(v) / len(v)} for name, v in scores.items()]
    print(format_table(rows, [("rule", "rule", ""), ("score %", "score", ".1f")]))
    if args.verbose:
        for name in presses:
            print(f"\n{name}:", *(f"  {'ok  ' if s else 'miss'} {r}" for s, r in zip(scores[name], replies[name])),
                  sep="\n")


QUERY_WINDOW = 32  # prompt queries averaged into the query anchor (SnapKV's observation window)


@contextlib.contextmanager
def captured_queries(model):
    """Each attention layer's query projection of the prompt's last `QUERY_WINDOW` tokens, by layer index (the
    first forward only: the prompt's)."""
    found, handles = {}, []
    for layer_idx, module in attention_modules(model).items():
        def hook(_, args, output, i=layer_idx):
            found.setdefault(i, output[:, -QUERY_WINDOW:].float())
        handles.append(query_projection(module).register_forward_hook(hook))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def query_anchor(model, queries: dict, cache) -> torch.Tensor:
    """`(1, D)`: the window's mean query before RoPE, each KV head's GQA group summed, in the page vectors'
    column layout (compressed layers in order, then KV heads, then channels). The page vectors are keys before
    RoPE, so the product ranks pages by what the question's queries look for, without positions."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    parts = []
    for i in cache.state.columns:
        q = queries[i][..., : heads * d]  # (a fused qkv projection: its queries)
        b, w, _ = q.shape
        parts.append(q.view(b, w, kv_heads, heads // kv_heads, d).sum(3).mean(1).flatten(1))
    return torch.cat(parts, dim=-1)


def standardised(scores: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """`scores` `(batch, pages)` less their mean over each row's candidate pages, over their standard deviation
    (0 for the other pages, which `select_by` never takes)."""
    scores = scores.masked_fill(~candidate, 0.0)
    mean = masked_mean(scores[..., None], candidate, dim=1)
    spread = masked_mean((scores - mean).square()[..., None], candidate, dim=1).sqrt()
    return ((scores - mean) / spread.clamp(min=1e-6)).masked_fill(~candidate, 0.0)


def ranks(scores: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Each candidate page's rank among the row's candidate pages by `scores` `(batch, pages)`, 0 for the worst
    (higher is better, as a score; 0 for the other pages, which `select_by` never takes)."""
    scores = scores.masked_fill(~candidate, float("-inf"))
    return scores.argsort(dim=-1).argsort(dim=-1).float().masked_fill(~candidate, 0.0)


def shares_standardised(vectors: torch.Tensor, anchor: torch.Tensor, candidate: torch.Tensor,
                        blocks: int) -> torch.Tensor:
    """Eq. 4 `(batch, pages)` as a sum over `blocks` equal column blocks of the page vectors `(batch, pages, D)`
    and anchor `(batch, D)` (layers, or layers x KV heads), each block's share standardised over the candidate
    pages before the sum."""
    b, n, _ = vectors.shape
    shares = (vectors.view(b, n, blocks, -1) * anchor.view(b, 1, blocks, -1)).sum(-1)  # (b, pages, blocks)
    return sum(standardised(shares[..., i], candidate) for i in range(blocks))


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    needle_arguments(parser, ratio=0.1, samples=20)
    parser.add_argument("--page-size", type=int, default=32, help="tokens per page (default: 32, the paper's)")
    parser.add_argument("--bounds", action="store_true", help="add the page-bound rule (see above)")
    parser.add_argument("--queries", action="store_true", help="add the query-anchor rule (see above)")
    parser.add_argument("--tokens", action="store_true", help="add the best-token rules (see above)")
    parser.add_argument("--per-layer", action="store_true", help="add the per-layer and per-head standardised "
                        "rules (see above)")
    parser.add_argument("--page-stride", type=int, default=None, help="add overlapping pages starting every N "
                        "tokens, max pooling (see above)")
    parser.add_argument("--answers", action="store_true", help="instead: the answers of CHESS (the default) and "
                        "of CHESS selecting by the --bounds or --tokens rule (see above), generated greedily")
    parser.add_argument("--verbose", action="store_true", help="with --answers: every reply, against its value")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    if args.answers:
        return answers(model, tokenizer, args)
    presses = rules(args.ratio, args.page_size)
    flat = flat_pages(args.page_size)
    query_rule = f"anchor: the last {QUERY_WINDOW} prompt queries (before RoPE), max pooling"
    if args.queries:
        presses[query_rule] = CHESSPress(ratio=args.ratio, **flat)
    bound_rule = "page bounds (Quest), max pooling, ratio split evenly"
    both_rule = "page means + page bounds, standardised, max pooling"
    layer_rules = {"each layer's share standardised, max pooling": "layer",
                   "each layer and KV head's share standardised, max pooling": "head"}
    if args.per_layer:
        for name in layer_rules:
            presses[name] = CHESSPress(ratio=args.ratio, **flat)
    token_rule = "page's best token, max pooling"
    mixed_rule = "page means + page's best token, standardised, max pooling"
    ranked_rule = "page means + page's best token, ranks summed, max pooling"
    if args.tokens:
        presses[token_rule] = CHESSPress(ratio=args.ratio, **flat)
        presses[mixed_rule] = presses[ranked_rule] = presses[token_rule]
    if args.bounds:
        presses[bound_rule] = CHESSPress(ratio=args.ratio, **flat)
        presses[both_rule] = presses[bound_rule]
    if args.page_stride:
        presses[f"overlapping pages (page_stride={args.page_stride}), max pooling"] = CHESSPress(
            ratio=args.ratio, page_size=args.page_size, page_stride=args.page_stride, pooling="max")
    kept = {name: 0 for name in presses}
    pages = {name: [] for name in presses}
    tokens = {name: [] for name in presses}
    for _, _, ids, (first, end) in tqdm(swept_samples(tokenizer, args.task, args.length, args.samples),
                                        total=args.samples, desc="samples"):
        first_press = min(presses.values(), key=lambda press: press.page_stride)  # the finest blocks serve all
        with first_press(model), captured_queries(model) as queries:
            out = model.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
        lengths = torch.tensor([ids.shape[1]])
        for name, press in presses.items():
            sums = regrouped(out.cache.state.page_sums, first_press.page_stride, press)
            if name == query_rule:
                vectors, _, candidate = press.page_vectors(sums, lengths)
                anchor = query_anchor(model, queries, out.cache)
                _, _, selected = press.select_by((vectors @ anchor[:, :, None])[..., 0], candidate)
            elif name in layer_rules:
                vectors, anchor, candidate = press.page_vectors(sums, lengths)
                blocks = len(out.cache.state.columns) * (model.config.num_key_value_heads
                                                         if layer_rules[name] == "head" else 1)
                _, _, selected = press.select_by(shares_standardised(vectors, anchor, candidate, blocks), candidate)
            elif name == bound_rule:
                _, _, selected = press.select_by(*bound_scores(model, out.cache, press, ids.shape[1], sums))
            elif name == token_rule:
                _, _, selected = press.select_by(*token_scores(model, out.cache, press, ids.shape[1], sums))
            elif name in (mixed_rule, ranked_rule):
                best, candidate = token_scores(model, out.cache, press, ids.shape[1], sums)
                vectors, anchor, _ = press.page_vectors(sums, lengths)
                mean = (vectors @ anchor[:, :, None])[..., 0]
                combine = standardised if name == mixed_rule else ranks
                _, _, selected = press.select_by(combine(mean, candidate) + combine(best, candidate), candidate)
            elif name == both_rule:
                bound, candidate = bound_scores(model, out.cache, press, ids.shape[1], sums)
                vectors, anchor, _ = press.page_vectors(sums, lengths)
                mean = (vectors @ anchor[:, :, None])[..., 0]
                _, _, selected = press.select_by(standardised(mean, candidate) + standardised(bound, candidate),
                                                 candidate)
            else:
                _, _, selected = press.select(sums, lengths)
            blocks = press.blocks_of(selected)
            always, _ = press.block_roles(lengths, blocks.shape[1])
            attended = blocks[0] | always[0]
            kept[name] += bool(attended[first // press.page_stride: (end - 1) // press.page_stride + 1].all())
            pages[name].append(int(selected[0].sum()))
            tokens[name].append(min(int(attended.sum()) * press.page_stride, ids.shape[1]))
    rows = [{"rule": name, "needles kept": f"{kept[name]} / {args.samples}",
             "pages selected": sum(pages[name]) / len(pages[name]),
             "tokens attended": sum(tokens[name]) / len(tokens[name])} for name in presses]
    print(f"{args.model}, {args.task}, {args.length} tokens, ratio {args.ratio}, {args.samples} samples")
    print(format_table(rows, [("rule", "rule", ""), ("needles kept", "needles kept", ""),
                              ("pages selected (mean)", "pages selected", ".1f"),
                              ("prompt tokens attended (mean)", "tokens attended", ".0f")]))


if __name__ == "__main__":
    main()
