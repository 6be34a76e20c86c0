"""The documentation's code runs as pasted."""

from __future__ import annotations

import pathlib
import re
import sys
import types

import pytest
import torch
from conftest import greedy, make_model, prompt

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


@pytest.mark.slow
def test_the_readmes_python_runs_as_pasted(capsys, monkeypatch):
    """Each of the README's Python blocks in a namespace of its own, as a user pastes one into a fresh session
    (the model is loaded once for all of them): each finds the needle, the compiled one too (on a CPU)."""
    import functools

    import sparsekv.models

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) == 2 and "compile=True" in blocks[1]
    monkeypatch.setattr(sparsekv.models, "load_model", functools.cache(sparsekv.models.load_model))
    # (other tests' graphs in this process.) Not `monkeypatch.setattr`: its undo deletes a torch config entry that
    # is not in the module's `__dict__`, which hides it from every later compile.
    with torch._dynamo.config.patch(recompile_limit=64):
        for block in blocks:
            namespace = {"__name__": "__main__"}
            exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
            out = capsys.readouterr().out
            assert out.split("| expected:")[0].strip().rstrip(".") == namespace["answer"].rstrip("."), out


@pytest.mark.slow
def test_writing_a_press_runs_as_pasted(capsys, monkeypatch):
    """Its blocks, in order, in one namespace: the press defined, then used on the offline model."""
    blocks = python_blocks("writing-a-press.md")
    assert len(blocks) == 3
    module = types.ModuleType("writing_a_press")  # as a script of the user's own: a module of its own
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for block in blocks:
        exec(compile(block, "docs/writing-a-press.md", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "| expected:" in out and "slots held per layer" in out
    press = namespace["KeyNormPress"](ratio=0.25)
    with pytest.raises(TypeError, match="unknown option window=8"):  # a press of one's own gets the core's checks
        namespace["KeyNormPress"](ratio=0.25, window=8)
    assert press.min_kept() == (8, "recent=8")


def eviction_example(monkeypatch) -> type:
    """The page's eviction press (its third block), defined as a user's module defines it."""
    blocks = python_blocks("writing-a-press.md")
    module = types.ModuleType("eviction_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for block in (blocks[0], blocks[2]):  # the imports, then the press
        exec(compile(block, "docs/writing-a-press.md", "exec"), module.__dict__)  # noqa: S102
    return module.TOVAPress


@pytest.mark.parametrize("batch", [1, 2])
def test_the_eviction_example_holds_its_budget_while_decoding(monkeypatch, batch):
    """TOVA as the page writes it: every layer holds its budget from the prompt to the last token, each step
    evicting what its query attends least (the step's newest token may go), and ratio=1.0 is the plain model."""
    tova = eviction_example(monkeypatch)
    model, ids = make_model("llama"), prompt(40, batch=batch)
    with tova(budget=16)(model):
        out = greedy(model, ids, new=12, return_dict_in_generate=True)
    cache = out.cache
    assert cache.get_seq_length() == 40 + 11
    for layer in cache.compressed_layers():
        assert layer.slots == 16 and bool(layer.valid.all())
        assert (layer.positions.sort(-1).values.diff(dim=-1) > 0).all()  # no token held twice
        assert bool((layer.positions < 40).any()) and bool((layer.positions >= 40).any())  # old and new kept
    plain = greedy(model, ids, new=12)
    with tova(ratio=1.0)(model):
        assert torch.equal(greedy(model, ids, new=12), plain)
