"""The press contract: the names a press reads of the core are the ones docs/writing-a-press.md lists."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from sparsekv.press import Press, ScorerPress

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRESSES = ROOT / "sparsekv" / "presses"
NAMED = {"ctx", "cache", "layer", "call", "forward"}  # the phases' argument, and the core objects, in press files
# The helpers a press inherits (not the phases and factories it overrides).
PHASES = {"new_layer", "new_state", "begin_forward", "choose", "on_queries", "compress", "after_step",
          "end_forward", "crop", "read_piece", "prompt_tail", "min_kept", "score", "score_step", "label",
          "make_cache", "holds_budget_while_decoding", "head_budgets", "attended_beside"}
HELPERS = {name for cls in (Press, ScorerPress) for name, value in vars(cls).items()
           if not name.startswith("_") and name not in PHASES
           and (callable(value) or isinstance(value, (staticmethod, classmethod)))}


def kind(node: ast.AST) -> str | None:
    """Which core object an expression of a press file stands for: the phases' context or a core object by its
    name, a core object reached through the context (`ctx.layer`), the forward reached through the cache, a layer
    taken from the cache's (or a local `layers`) list."""
    if isinstance(node, ast.Name):
        return node.id if node.id in NAMED else None
    if isinstance(node, ast.Attribute) and node.attr in NAMED - {"ctx"} and kind(node.value) == "ctx":
        return node.attr
    if isinstance(node, ast.Attribute) and node.attr == "forward" and kind(node.value) == "cache":
        return "forward"
    if isinstance(node, ast.Subscript):
        listed = node.value
        if isinstance(listed, ast.Name) and listed.id == "layers" or \
                isinstance(listed, ast.Attribute) and listed.attr == "layers" and kind(listed.value) == "cache" or \
                isinstance(listed, ast.Call) and isinstance(listed.func, ast.Attribute) and \
                listed.func.attr == "compressed_layers":
            return "layer"
    return None


def core_module(node: ast.ImportFrom) -> str | None:
    """The core module an import in a press file reads (`from ..attention import`, `from sparsekv.attention
    import`, `from .. import`), as `sparsekv.attention`; None for another press's module or a third party's."""
    if node.level == 2:
        module = "sparsekv" + (f".{node.module}" if node.module else "")
    elif node.level == 0 and (node.module or "").split(".")[0] == "sparsekv":
        module = node.module
    else:
        return None
    return None if module.startswith("sparsekv.presses") else module


def names_read(source: str) -> set[str]:
    """`object.name` for every core name `source` reads, `Press.name` for every inherited helper it calls, and
    `sparsekv.module.name` for every name it imports from the core (a module of `sparsekv` outside `presses`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = core_module(node)
            if module is not None:
                found |= {f"{module}.{alias.name}" for alias in node.names}
        if not isinstance(node, ast.Attribute):
            continue
        if kind(node.value):
            found.add(f"{kind(node.value)}.{node.attr}")
        elif isinstance(node.value, ast.Name) and node.value.id in ("self", "press", "Press") and node.attr in HELPERS:
            found.add(f"Press.{node.attr}")
    return found


def press_files() -> list[pathlib.Path]:
    return [f for f in sorted(PRESSES.glob("*.py")) if f.name not in ("__init__.py", "registry.py")]


def documented() -> set[str]:
    """The names listed under "What a press reads of the core"."""
    page = (ROOT / "docs" / "writing-a-press.md").read_text()
    section = page.split("## What a press reads of the core", 1)[1].split("\n## ", 1)[0]
    names = {f"{obj}.{name}" for obj, name in re.findall(r"`(ctx|cache|layer|call|forward)\.(\w+)", section)}
    names |= {f"sparsekv.{name}" for name in re.findall(r"`sparsekv\.(\w+\.\w+)`", section)}
    return names | {f"Press.{name}" for name in re.findall(r"`(?:self|Press)\.(\w+)", section)}


def test_every_name_a_press_reads_is_documented_and_every_documented_name_is_read():
    read = {}
    for path in press_files():
        for name in names_read(path.read_text()):
            read.setdefault(name, []).append(path.name)
    listed = documented()
    unlisted = {name: files for name, files in read.items() if name not in listed}
    assert not unlisted, f"press files read core names that docs/writing-a-press.md does not list: {unlisted}"
    assert not listed - set(read), f"docs/writing-a-press.md lists names no press reads: {listed - set(read)}"


def test_the_counts_the_page_gives_are_the_names_it_lists():
    """The page says how many names a press reads, attributes and helpers apart from imports: the numbers follow
    the list."""
    page = (ROOT / "docs" / "writing-a-press.md").read_text()
    total, attributes, imports = map(int, re.search(
        r"read of the core, (\d+): (\d+) attributes and helpers, and (\d+)\s+types", page).groups())
    listed = documented()
    imported = {name for name in listed if name.startswith("sparsekv.")}
    assert (total, attributes, imports) == (len(listed), len(listed - imported), len(imported))


@pytest.mark.parametrize("source, expected", [
    ("def f(cache, layer):\n    cache.forward.plan = layer.keys\n", {"cache.forward", "forward.plan", "layer.keys"}),
    ("def f(ctx):\n    ctx.layer.extra\n    ctx.keys\n    ctx.cache.counts\n    ctx.call.module\n",
     {"ctx.layer", "layer.extra", "ctx.keys", "ctx.cache", "cache.counts", "ctx.call", "call.module"}),
    ("def f(cache):\n    cache.layers[0].store_keys\n    cache.compressed_layers()[-1].slots\n",
     {"cache.layers", "cache.compressed_layers", "layer.store_keys", "layer.slots"}),
    ("def f(self, ctx, s):\n    self.row_budgets(ctx, s)\n    self.window_size\n", {"Press.row_budgets"}),
    (("from ..attention import rotate, query_norm\nfrom .snapkv import SnapKVPress\nfrom ..presses import x\n"
      "from sparsekv.store import offloaded\nfrom sparsekv.presses.h2o import H2OPress\nfrom torch import nn\n"),
     {"sparsekv.attention.rotate", "sparsekv.attention.query_norm", "sparsekv.store.offloaded"}),
])
def test_the_scan_sees_the_names_a_press_reads(source, expected):
    """The scan that guards the list finds a name however a press reaches it (through the forward, a layer
    taken from the cache, an inherited helper, an import from the core), and not a press's own option or another
    press's module."""
    assert names_read(source) == expected


SCORING = ("snapkv.py", "chunkkv.py", "knorm.py", "keydiff.py", "tova.py", "streaming_llm.py", "h2o.py", "floored.py",
           "pyramidkv.py", "adakv.py", "expected_attention.py")


def test_a_scoring_press_reads_the_context_alone():
    """The presses that score (the prompt, and while decoding) reach the core through the context they are handed
    and the press's helpers, never through a layer, an attention call or the forward, and the context names they
    read together are about a dozen: what docs/writing-a-press.md's first table lists. (A factory, `new_state`,
    gets the cache.)"""
    read = set()
    for name in SCORING:
        read |= names_read((PRESSES / name).read_text())
    beyond = {n for n in read if n.split(".")[0] in ("layer", "call", "forward") or n in ("ctx.layer", "ctx.call")}
    assert not beyond, f"scoring presses read the core beyond the context: {beyond}"
    context = {n for n in read if n.startswith("ctx.")}
    page = (ROOT / "docs" / "writing-a-press.md").read_text()
    table = page.split("## What `ctx` gives a scoring press", 1)[1].split("\n## ", 1)[0]
    assert context <= set(re.findall(r"`(ctx\.\w+)", table)), context - set(re.findall(r"`(ctx\.\w+)", table))
    assert len(context) <= 15, sorted(context)
