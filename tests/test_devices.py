"""Every press on the device and in the dtype a model runs in: the tiny-model matrix in float32 and bfloat16.

Runs on the CPU by default; `python -m pytest tests/test_devices.py --device cuda` runs it (and every model of
the suite: `conftest.make_model` and `conftest.prompt` follow `--device`) on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, DEVICE, IMPLEMENTATIONS, greedy, make_model, prompt
from test_generate_modes import PRESSES, tiny_press
from transformers import DynamicCache

from sparsekv import KVLayer, StoreLayer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Logits of a ratio-1 press against the full cache's: bit-equal kernels are not promised across the two paths
# (a press's cache can give attention an explicit mask where the full cache gives none), so within rounding
# of the dtype; a kept token at a wrong position or a dropped one moves these tiny models' logits by ~1.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def cache_tensors(layer) -> dict[str, torch.Tensor]:
    """Every tensor a cache layer holds, by attribute name (its `extra` state included)."""
    found = {k: v for k, v in vars(layer).items() if isinstance(v, torch.Tensor)}
    for key, value in getattr(layer, "extra", {}).items():
        if isinstance(value, torch.Tensor):
            found[f"extra[{key!r}]"] = value
    return found


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_a_padded_batch_compresses_on_the_device_in_the_dtype(press_cls, arch, impl, dtype):
    model = make_model(arch, impl).to(dtype)
    ids = prompt(64, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # row 1 is left-padded
    press = tiny_press(press_cls, ratio=0.25)
    with press(model):
        out = greedy(model, ids.masked_fill(mask == 0, 0), mask, new=5, return_dict_in_generate=True)
    layers = [layer for layer in out.cache.layers if isinstance(layer, KVLayer)]
    assert layers and out.sequences.shape == (2, 69)
    for i, layer in enumerate(layers):
        assert layer.keys.dtype == layer.values.dtype == dtype, i
        for name, tensor in cache_tensors(layer).items():
            # a store may live elsewhere on purpose (SentencePress's offload_device); everything else is here
            stored = isinstance(layer, StoreLayer) and name in ("store_keys", "store_values")
            home = layer.store_device if stored else None
            assert tensor.device == (home or torch.device(DEVICE.type, tensor.device.index)), (i, name)
    stats = out.cache.stats()
    assert stats.logical_tokens == 64 + 5 - 1
    assert max(stats.attended_tokens) < 64  # compressed: both rows attend fewer than their prompt


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("press_cls", PRESSES, ids=lambda c: c.__name__)
def test_ratio_one_gives_the_full_caches_logits_in_the_dtype(press_cls, impl, dtype):
    model = make_model("llama", impl).to(dtype)
    ids, follow = prompt(64), prompt(4, seed=9)

    def logits(cache=None):
        out = model(ids, cache=cache, use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(follow.shape[1]):  # teacher-forced: both see the same tokens whatever they predict
            out = model(follow[:, t : t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits[:, -1])
        return torch.stack(steps, 1).float()

    reference = logits(DynamicCache(config=model.config))
    with tiny_press(press_cls, ratio=1.0)(model):
        pressed = logits()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(pressed, reference, rtol=tol, atol=tol)
