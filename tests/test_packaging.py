"""Packaging: one version, typed, and a core that needs none of the extras."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import metadata, requires, version
from pathlib import Path

import pytest

import sparsekv
from sparsekv.cli import main

EXTRAS_MODULES = ("matplotlib", "accelerate", "datasets", "psutil", "gguf", "pandas")


def test_one_version(capsys):
    assert sparsekv.__version__ == version("sparsekv")
    try:
        main(["--version"])
    except SystemExit as done:
        assert done.code == 0
    assert capsys.readouterr().out.strip() == f"sparsekv {version('sparsekv')}"


def test_metadata_license_and_typed():
    meta = metadata("sparsekv")
    assert meta["License-Expression"] == "Apache-2.0"
    assert (Path(sparsekv.__file__).parent / "py.typed").exists()
    assert "Apache License" in (Path(sparsekv.__file__).parent.parent / "LICENSE").read_text()


def test_core_dependencies_are_lean():
    core = {r.split(">")[0].split("<")[0].split("=")[0].strip() for r in requires("sparsekv") if "extra ==" not in r}
    assert core == {"torch", "transformers", "nltk", "numpy", "tqdm"}


def test_compressing_a_generation_loads_no_extra():
    """In fresh interpreters: a generation compressed by a press built from a spec loads no optional package that
    the same generation without sparsekv does not (transformers itself imports some when they are installed)."""
    code = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(3, 64, (1, 40))
generate = lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                  pad_token_id=0)
if sys.argv[1] == "press":
    import sparsekv
    with sparsekv.make_press("chunkkv:ratio=0.5,window_size=8,chunk_size=4")(model):
        generate()
else:
    generate()
print(" ".join(sorted(m for m in sys.argv[2:] if m in sys.modules)))
"""

    def loaded(mode: str) -> set[str]:
        out = subprocess.run([sys.executable, "-c", code, mode, *EXTRAS_MODULES], capture_output=True, text=True,
                             check=True)
        return set(out.stdout.strip().splitlines()[-1].split()) if out.stdout.strip() else set()

    assert loaded("press") <= loaded("plain")


def test_docs_hold_no_placeholders():
    """A line such as `SNAPKV_MORE` is a note to self left where a table row or a paragraph was to go (two
    landed in docs/results.md once); mkdocs renders it as text without a word."""
    root = Path(__file__).parents[1]
    placeholder = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)+$")
    found = [f"{path.relative_to(root)}:{number}: {line}"
             for path in [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").rglob("*.md"))]
             for number, line in enumerate(path.read_text().splitlines(), 1) if placeholder.match(line.strip())]
    assert not found, found


def test_the_code_keeps_to_its_line_length():
    """pyproject.toml's `line-length` holds for every Python file of the package, its tests and benchmarks (no
    linter runs in CI, so this is what keeps lines within it)."""
    root = Path(__file__).parents[1]
    limit = int(re.search(r"^line-length\s*=\s*(\d+)", (root / "pyproject.toml").read_text(), re.M).group(1))
    found = [f"{path.relative_to(root)}:{number}"
             for folder in ("sparsekv", "tests", "benchmarks") for path in sorted((root / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > limit]
    assert not found, found


def test_the_help_lists_what_the_library_has():
    """The command line's help names the presses, tasks and dtypes without importing them (a quick `--help`):
    its lists are the registry's, the tasks' and the models' own."""
    from sparsekv.cli.args import DTYPES, MODEL_NAMES, PRESS_NAMES, TASK_NAMES
    from sparsekv.evaluation import TASKS
    from sparsekv.models import DTYPES as MODEL_DTYPES
    from sparsekv.models import MODELS
    from sparsekv.presses.registry import BUILT_IN

    assert PRESS_NAMES == tuple(BUILT_IN) and TASK_NAMES == tuple(TASKS) and DTYPES == MODEL_DTYPES
    assert MODEL_NAMES == tuple(MODELS)


def test_import_and_help_load_no_torch():
    """`import sparsekv` and `sparsekv --help` load neither torch nor transformers (seconds of start-up); the
    first press used does."""
    code = ("import sys, sparsekv; from sparsekv.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); "
            "sparsekv.SnapKVPress; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True"], out


@pytest.mark.parametrize("order", ["sparsekv first", "transformers' pipelines first"])
def test_the_pipeline_task_is_registered_whichever_is_imported_first(order):
    imports = ["import sparsekv", "from transformers.pipelines import PIPELINE_REGISTRY"]
    code = "; ".join(imports if order == "sparsekv first" else imports[::-1]) + \
        "; print('sparsekv-text-generation' in PIPELINE_REGISTRY.get_supported_tasks())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_the_demos_extra_holds_what_loading_an_offline_model_needs():
    """The README's first command installs `[gguf]` alone: transformers loads a GGUF file with gguf and accelerate."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    extra = re.search(r'^gguf = \[(.*?)\]', text, re.M).group(1)
    assert '"gguf' in extra and '"accelerate' in extra
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert 'pip install -e ".[gguf]" -c constraints.txt && sparsekv demo' in readme


def test_the_readme_stays_short():
    """A newcomer reads the README top to bottom: at most 180 lines, the details in docs/."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert len(readme.splitlines()) <= 180


def test_the_docs_keep_no_run_diary():
    """README and docs say what was measured, where and with which command: no dated run notes."""
    root = Path(__file__).parents[1]
    dated = re.compile(r"\b20\d\d-\d\d(-\d\d)?\b")
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    found = [f"{path.relative_to(root)}:{number}" for path in pages
             for number, line in enumerate(path.read_text().splitlines(), 1) if dated.search(line)]
    assert not found, found
