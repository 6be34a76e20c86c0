"""The documentation's code runs as pasted."""

from __future__ import annotations

import pathlib
import re
import sys
import types

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


@pytest.mark.slow
def test_writing_a_press_runs_as_pasted(capsys, monkeypatch):
    """Its blocks, in order, in one namespace: the press defined, then used on the offline model."""
    blocks = python_blocks("writing-a-press.md")
    assert len(blocks) == 2
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
