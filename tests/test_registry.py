"""The one press registry: names, spec strings, typed options, and presses of other packages (entry points)."""

from __future__ import annotations

import textwrap

import pytest
from conftest import greedy, make_model, make_tokenizer, prompt

import sparsekv
from sparsekv import CHESSPress, ChunkPress, SentencePress, SnapKVPress, make_press
from sparsekv.bench import sweep
from sparsekv.evaluation import EvalConfig
from sparsekv.presses.registry import registered, split_specs


def test_specs_build_presses_with_typed_options():
    assert make_press("chunkkv:ratio=0.1,reuse_layers=1") == ChunkPress(ratio=0.1, reuse_layers=1)
    assert make_press("chunkkv:ratio=0.1:reuse_layers=1") == ChunkPress(ratio=0.1, reuse_layers=1)
    assert make_press("ChunkKVPress:budget=64") == make_press("chunkpress", budget=64) == ChunkPress(budget=64)
    assert make_press("SNAPKV:pooling=avg", ratio=0.5) == SnapKVPress(ratio=0.5, pooling="avg")
    chess = make_press("chess:ratios=(0.5,0.2,0.1),reselect=always,pre_rope=false")
    assert chess == CHESSPress(ratios=(0.5, 0.2, 0.1), reselect="always", pre_rope=False)
    assert make_press("chess:preset=aggressive", ratio=0.1) == CHESSPress(preset="aggressive")  # preset wins
    assert isinstance(make_press("sentencekv:keep_factor=3", tokenizer=make_tokenizer(), budget=64), SentencePress)


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown press 'nope'; known presses: snapkv, h2o"),
    ("snapkv:window=3", "SnapKVPress has no option 'window'; its options: ratio, budget, compile, window_size"),
    ("snapkv:window_size=abc", "option window_size must be int; got 'abc'"),
    ("h2o:ratio=true", "option ratio must be float; got 'true'"),
    ("snapkv:ratio=1.5", r"ratio must be in \(0, 1\]"),
    ("snapkv:0.1", "options are key=value"),
    ("sentencekv:ratio=0.1", r"SentencePress needs the model's tokenizer: make_press\('sentencekv:ratio=0.1', "
                             r"tokenizer=tokenizer\)"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        make_press(spec)


def test_a_list_of_specs_keeps_each_press_options():
    assert split_specs("snapkv,chunkkv:ratio=0.1,reuse_layers=1,h2o, chess:ratios=(0.5,0.2,0.1),window_pages=3") == [
        "snapkv", "chunkkv:ratio=0.1,reuse_layers=1", "h2o", "chess:ratios=(0.5,0.2,0.1),window_pages=3"]


def test_the_evaluation_and_the_benchmark_use_the_registry_without_a_tokenizer():
    EvalConfig(model="m", tasks=["niah_single"], presses=["sentencekv:keep_factor=3", "full"])  # no placeholder
    with pytest.raises(ValueError, match="has no option 'keepfactor'"):
        EvalConfig(model="m", tasks=["niah_single"], presses=["sentencekv:keepfactor=3"])
    assert [s.press for s, _, _ in sweep([100], ["snapkv:window_size=8", "full"], ratios=[0.5])] == \
        ["snapkv:window_size=8"]


@pytest.fixture
def dummy_distribution(tmp_path, monkeypatch):
    """An installed package that registers a press `keynorm` through the `sparsekv.presses` entry points."""
    package = tmp_path / "dummy_sparsekv_press"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass

        from sparsekv import ScorerPress


        @dataclass(kw_only=True)
        class KeyNormPress(ScorerPress):
            """Keep the tokens whose keys have the smallest norm."""

            def score(self, ctx):
                return -ctx.keys.norm(dim=-1)
    '''))
    info = tmp_path / "dummy_sparsekv_press-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dummy-sparsekv-press\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[sparsekv.presses]\nkeynorm = dummy_sparsekv_press:KeyNormPress\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "keynorm"


def test_a_press_of_another_package_joins_by_name(dummy_distribution):
    assert "keynorm" in registered() and "keynorm" not in sparsekv.presses.registry.BUILT_IN
    press = make_press("KeyNorm:ratio=0.25")
    assert type(press).__name__ == "KeyNormPress" and press.ratio == 0.25
    EvalConfig(model="m", tasks=["niah_single"], presses=["keynorm"])  # `sparsekv eval --presses keynorm`
    assert sweep([100], ["keynorm"], ratios=[0.5])[0][0].press == "keynorm"  # `sparsekv bench --presses keynorm`
    model = make_model("llama")
    with press(model):
        out = greedy(model, prompt(64), new=3, return_dict_in_generate=True)
    assert all(n == 16 + 2 for n in out.cache.stats().resident_tokens)


def test_without_the_distribution_the_name_is_unknown():
    assert "keynorm" not in registered()
    with pytest.raises(ValueError, match="unknown press 'keynorm'"):
        make_press("keynorm:ratio=0.5")


def test_a_broken_plugin_is_logged_not_fatal(tmp_path, monkeypatch, caplog):
    info = tmp_path / "broken_press-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-press\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[sparsekv.presses]\nbroken = no_such_module:Nope\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "broken" not in registered() and "snapkv" in registered()
    assert "could not be loaded" in caplog.text
