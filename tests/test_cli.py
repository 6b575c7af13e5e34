"""The main job: ``python -m dla_recipes PROMPT --target TOKEN`` on the default model and on a local folder."""

import subprocess
import sys

import pytest

from dla_recipes.__main__ import main
from dla_recipes.testing import tiny


def test_main_job_on_the_default_model(capsys):
    assert main(["The Eiffel Tower is in the city of", "--target", " Paris", "--contrast", " Rome"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "family: llama" in out and "logit of ' Paris' - ' Rome'" in out
    start = lines.index(next(line for line in lines if line.strip().startswith("component"))) + 1
    rows = [line.split() for line in lines[start:start + 61]]  # embed + 30 blocks x (attn, mlp)
    assert {row[0] for row in rows} == {"embed"} | {f"L{i}.{t}" for i in range(30) for t in ("attn", "mlp")}
    values = [abs(float(row[1])) for row in rows]
    assert values == sorted(values, reverse=True)  # the largest contributions come first
    total = float(next(line for line in lines if line.startswith("sum of parts")).split()[-1])
    logit = float(next(line for line in lines if line.startswith("model's logit")).split()[-1])
    assert total == pytest.approx(logit, abs=1e-4 * abs(logit))


def test_main_job_on_a_folder_by_head(tmp_path, capsys):
    folder = tmp_path / "tiny-llama"
    tiny.build("llama").save_pretrained(folder)
    tiny.tokenizer().save_pretrained(folder)
    assert main(["w1 w2 w3", "--target", "w9", "--model", str(folder), "--by", "head", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "by: head" in out and "error:" in out


def test_bad_input_exits_with_a_clear_message(tmp_path, capsys):
    folder = tmp_path / "tiny-gpt2"
    tiny.build("gpt2").save_pretrained(folder)
    tiny.tokenizer().save_pretrained(folder)
    assert main(["w1 w2", "--target", "w1 w2", "--model", str(folder)]) == 2
    assert "error: target 'w1 w2' is 2 tokens" in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "dla_recipes", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--target" in result.stdout
