"""What a forward's attention masks say, and the mask of a compressed layer: which tokens of a forward are real
(generate's 2D mask, or the 4D one it builds for a compiled cache), that padding is on the left, and the
physical mask over the slots a compressed layer holds (`SparseCache.before_layer`), and which layers share one
(`step_layouts`)."""

from __future__ import annotations

import torch


def padding_mask(mask, first: bool, q: int) -> torch.Tensor | None:
    """A forward's `attention_mask` as the 2D `(batch, kv)` mask of which tokens are real, or None.

    generate gives a compiled cache's forwards 4D masks `(batch, 1, q, kv)` (boolean or additive; per layer
    type in a dict for models that mix them): at a first forward their first `q` keys are the prompt (the
    others, a static cache's unwritten slots when generate made its mask for one: a press's `compile`), and the
    last query's row, which sees every earlier key causally and no padding, tells which are real. A later
    forward's are read
    as None (every new token real, as generate's steps are): its columns follow the logical layout, not the
    slots a compressed layer holds."""
    if isinstance(mask, dict):
        mask = mask.get("full_attention")
    if not isinstance(mask, torch.Tensor) or mask.ndim not in (2, 4):
        return None
    if mask.ndim == 4:
        if not first:
            return None
        row = mask[:, 0, -1, :q]
        return row if row.dtype == torch.bool else row == 0
    return mask


def check_left_padded(attention_mask: torch.Tensor) -> None:
    """Refuse a 2D attention mask with padding after a real token (right padding, or gaps): a press counts each
    row's tokens from its first real one, as generate pads decoder-only models (on the left)."""
    mask = attention_mask.bool()
    late = mask[:, :-1] & ~mask[:, 1:]  # a real token followed by padding
    if bool(late.any()):
        row = int(late.any(-1).long().argmax())
        raise ValueError(f"attention_mask: row {row} has padding after its first real token (padded on the right?); "
                         "sparsekv needs prompts padded on the left, as decoder-only generation does: set "
                         "`tokenizer.padding_side = \"left\"` before tokenizing.")


def physical_mask(past_valid: torch.Tensor, new_valid: torch.Tensor, impl: str, dtype: torch.dtype,
                  groups: int = 1):
    """The attention mask of a compressed layer: past slots by validity, new tokens causal among themselves.

    `past_valid` is `(batch, slots)` when every head of a row holds the same validity, else `(batch, kv_heads,
    slots)`, and `groups` query heads read each KV head. Returns what the attention implementation expects: None
    when nothing is masked; a 2D `(batch, kv)` mask for flash attention (it aligns causality bottom-right, which
    matches new tokens appended last; one per row, so its heads must agree); a 4D boolean mask for sdpa, a 4D
    additive float mask for eager, `(batch, 1, q, kv)` or per query head `(batch, heads, q, kv)`.
    """
    q = new_valid.shape[1]
    per_head = past_valid.dim() == 3
    new_valid = new_valid.to(past_valid.device)
    if per_head:
        new_valid = new_valid[:, None, :].expand(-1, past_valid.shape[1], -1)
    kv_valid = torch.cat([past_valid, new_valid], dim=-1)
    # Compiling, the mask is kept even where every slot is real: whether they are is a host read.
    mask_all = torch.compiler.is_compiling()
    if impl.startswith("flash"):
        if per_head:
            raise ValueError(f"sparsekv: the heads of a row keep different tokens (head-wise budgets), and "
                             f"attn_implementation={impl!r} takes one mask per row; load the model with "
                             "attn_implementation=\"sdpa\" (or \"eager\").")
        return None if not mask_all and bool(kv_valid.all()) else kv_valid
    if q == 1 and not mask_all and bool(kv_valid.all()):
        return None
    n = past_valid.shape[-1]
    if per_head:  # (batch, kv_heads, q, kv), each KV head's row repeated for its query heads
        mask = kv_valid.repeat_interleave(groups, dim=1)[:, :, None, :].expand(-1, -1, q, -1).clone()
    else:
        mask = kv_valid[:, None, None, :].repeat(1, 1, q, 1)
    mask[..., n:] &= torch.ones(q, q, dtype=torch.bool, device=mask.device).tril()
    if impl == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def step_layouts(layers: dict) -> dict[int, int]:
    """Each compressed layer's index (`layers`: index to `KVLayer`) to its layout's: the first of them that holds
    the same validity on the same device (`same_layout`), whose mask and free slot a decoding step finds once
    for all of them (`SparseCache.layouts`)."""
    layouts, leaders = {}, []
    for i, layer in layers.items():
        leader = next((j for j in leaders if same_layout(layers[j], layer)), None)
        if leader is None:
            leaders.append(leader := i)
        layouts[i] = leader
    return layouts


def same_layout(a, b) -> bool:
    """Whether layers `a` and `b` hold the same validity on one device: a step's mask and free slot serve both."""
    return (a.device == b.device and a.slots == b.slots and a.heads_agree == b.heads_agree
            and torch.equal(a.valid, b.valid))
