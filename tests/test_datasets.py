"""``attribute_dataset``: a dataset in chunks, to rows in memory or a resumable Parquet directory.

Every kind of dataset (a list of dicts, a DataFrame, a Hugging Face ``Dataset``, a generator) gives the rows
``attribute`` gives on the same prompts, and those rows sum to a plain transformers forward's own logits; a run
killed after some chunks and called again with the same ``out=`` ends with the file of one uninterrupted run; a
directory written by another call, or data read in another order, is refused; a malformed chunk is one
``InputError`` naming every bad row and column.
"""

from __future__ import annotations

import json

import bounds
import pandas as pd
import pytest
import torch
from conftest import plain_logits, tiny_model
from test_positions import ids_of, linear_rounding, own_logits

import dla_recipes
import dla_recipes.datasets as dla_datasets
from dla_recipes import InputError, RemoteBatchError, RemoteError
from dla_recipes.datasets import Column, Same
from dla_recipes.present import parquet

FAMILY = "llama"  # padding-safe: a chunk of rows is one batch of consecutive prompts, as attribute batches them
ROWS = [{"prompt": " ".join(f"w{5 + (3 * i + j) % 90}" for j in range(2 + i % 5)), "answer": f"w{20 + i % 7}",
         "foil": 40 + i % 3} for i in range(11)]
BATCH = 4


def row_limits(model, frame) -> torch.Tensor:
    """``[rows]``: how far a row (its parts, constant and logit) may move between two forwards of its prompt (a plain
    forward alone, another batch): both forwards' rounding of its logit difference (bounds.py's model, through
    ``test_positions.linear_rounding``; measured before: 1.3e-7 at most, against 2e-5 to 3e-5 allowed)."""
    seen, limits = {}, []
    for _, row in frame.iterrows():
        prompt = row["prompt"]
        if prompt not in seen:
            seen[prompt] = (own_logits(model, prompt), bounds.logit_rounding(model, ids_of(model, prompt)))
        z, rounding = seen[prompt]
        target = model.tokenizer.convert_tokens_to_ids(row["target"])
        foil = int(ROWS[row["row"]]["foil"])
        difference = lambda b, p, z, t=target, c=foil: z[p, t] - z[p, c]
        limits.append(2 * linear_rounding(difference, 0, int(row["position"]), z, rounding))
    return torch.tensor(limits, dtype=torch.float64)


@pytest.fixture(scope="module")
def model():
    return tiny_model(FAMILY)


def run(model, data, tmp_path, name="rows.parquet", **options):
    options = {"target": "answer", "contrast": "foil", "batch_size": BATCH, "progress": False, **options}
    return pd.read_parquet(dla_recipes.attribute_dataset(model, data, out=tmp_path / name, **options))


def components(frame) -> list[str]:
    return [c for c in frame.columns if c not in parquet.FIXED]


def test_every_kind_of_dataset_gives_the_rows_attribute_gives(model, tmp_path):
    import datasets

    expected = dla_recipes.attribute(model, [r["prompt"] for r in ROWS], [r["answer"] for r in ROWS],
                                     contrast=[r["foil"] for r in ROWS], by="head", batch_size=BATCH)
    kinds = {"list": ROWS, "frame": pd.DataFrame(ROWS), "hf": datasets.Dataset.from_list(ROWS),
             "generator": (dict(r) for r in ROWS)}
    frames = {kind: run(model, data, tmp_path, f"{kind}.parquet", by="head") for kind, data in kinds.items()}
    first = frames["list"]
    assert first["row"].tolist() == list(range(len(ROWS)))
    assert first["prompt"].tolist() == [r["prompt"] for r in ROWS]
    assert first["target"].tolist() == list(expected.target_tokens)
    assert components(first) == expected.labels
    assert torch.equal(torch.tensor(first[expected.labels].to_numpy()), expected.values)
    assert torch.equal(torch.tensor(first["logit"].to_numpy()), expected.logit)
    assert torch.equal(torch.tensor(first["constant"].to_numpy()), expected.constant)
    for kind, frame in frames.items():
        pd.testing.assert_frame_equal(frame, first, check_exact=True, obj=kind)
    in_memory = dla_recipes.attribute_dataset(model, pd.DataFrame(ROWS), target="answer", contrast="foil", by="head",
                                              batch_size=BATCH)
    assert in_memory == expected


def test_the_rows_sum_to_a_plain_forward_of_each_prompt(model, tmp_path):
    frame = run(model, ROWS, tmp_path, position=[-2, -1])
    ids = model.tokenizer
    gaps = []
    for _, row in frame.iterrows():
        logits = plain_logits(model, row["prompt"]).double()
        answer = ids.convert_tokens_to_ids(row["target"])
        own = logits[row["position"], answer] - logits[row["position"], int(ROWS[row["row"]]["foil"])]
        total = row[components(frame)].astype(float).sum() + float(row["constant"])
        gaps.append(max(abs(total - float(own)), abs(float(row["logit"]) - float(own))))
    assert len(frame) == sum(min(2, len(r["prompt"].split())) for r in ROWS)
    ratio = float((torch.tensor(gaps, dtype=torch.float64) / row_limits(model, frame)).max())
    assert ratio <= 1, ratio  # both forwards' rounding of each row's logit (row_limits)


def test_batch_size_does_not_change_the_rows(model, tmp_path):
    frames = [run(model, ROWS, tmp_path, f"b{size}.parquet", batch_size=size) for size in (1, 3, 11)]
    for frame in frames[1:]:
        assert frame[["row", "position", "prompt", "target", "contrast"]].equals(
            frames[0][["row", "position", "prompt", "target", "contrast"]])
        gap = torch.tensor((frame[components(frame)] - frames[0][components(frame)]).abs().to_numpy().max(-1))
        ratio = float((gap / row_limits(model, frame)).max())
        assert ratio <= 1, ratio  # both batchings' rounding of each row's logit (row_limits)
    assert len(list((tmp_path / "b3.parquet").glob("part-*.parquet"))) == 4  # one part a chunk


class Killed(Exception):
    pass


def dies_after(rows, k):
    """The rows as a generator that dies (as a killed process) when asked for row ``k``."""
    for i, row in enumerate(rows):
        if i == k:
            raise Killed(f"killed at row {k}")
        yield row


def test_a_killed_run_resumes_to_the_rows_of_one_uninterrupted_run(model, tmp_path, monkeypatch):
    whole = run(model, ROWS, tmp_path, "whole.parquet", by="head")
    out = tmp_path / "killed.parquet"
    with pytest.raises(Killed):
        run(model, dies_after(ROWS, 9), tmp_path, "killed.parquet", by="head")
    assert len(list(out.glob("part-*.parquet"))) == 2  # chunks 0..3 and 4..7 finished; 8 was being read
    assert sorted(pd.read_parquet(out)["row"]) == list(range(8))
    # a second kill, mid-write of a part: the part's hidden file is left half written, nothing renamed in place
    real = parquet.Parts.write

    def dies_writing(self, frame):
        (self.path / f".part-{int(frame['row'].min()):012d}.parquet.tmp").write_bytes(b"PAR1 half a part")
        raise Killed("killed while writing")

    monkeypatch.setattr(parquet.Parts, "write", dies_writing)
    with pytest.raises(Killed):
        run(model, ROWS, tmp_path, "killed.parquet", by="head")
    assert sorted(pd.read_parquet(out)["row"]) == list(range(8))  # still readable, the same rows
    monkeypatch.setattr(parquet.Parts, "write", real)
    resumed = run(model, ROWS, tmp_path, "killed.parquet", by="head")
    pd.testing.assert_frame_equal(resumed, whole, check_exact=True)
    assert not list(out.glob(".*.tmp"))
    assert sorted(p.name for p in out.glob("part-*")) == sorted(p.name for p in (tmp_path / "whole.parquet").glob("part-*"))
    again = run(model, ROWS, tmp_path, "killed.parquet", by="head")  # all done: nothing runs, nothing changes
    pd.testing.assert_frame_equal(again, whole, check_exact=True)


def test_a_run_stopped_by_hand_says_how_to_resume(model, tmp_path, monkeypatch):
    """Ctrl-C (or a notebook's stop button) during a chunk's forward: the error says which rows are kept where, and
    how to go on."""
    from dla_recipes.datasets import stream

    real, calls = stream.RowsSink.run, []

    def stopped_in_the_third(self, chunk):
        calls.append(chunk.rows[0])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, chunk)

    monkeypatch.setattr(stream.RowsSink, "run", stopped_in_the_third)
    with pytest.raises(KeyboardInterrupt) as info:
        run(model, ROWS, tmp_path, "stopped.parquet")
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert f"chunk 3 (rows 8..{min(12, len(ROWS)) - 1})" in note and "the 8 row(s) before it are kept in out=" in note, note
    assert "same out=" in note
    monkeypatch.setattr(stream.RowsSink, "run", real)
    assert sorted(run(model, ROWS, tmp_path, "stopped.parquet")["row"]) == list(range(len(ROWS)))


def test_a_resumed_directory_must_be_the_same_call_on_the_same_data(model, tmp_path):
    run(model, ROWS[:6], tmp_path, "a.parquet")
    for change in ({"by": "head"}, {"position": [-1]}, {"contrast": "mean"}, {"target": Same("w20")},
                   {"reduce": "sum", "position": "all"}):
        with pytest.raises(InputError, match="written by a different call") as info:
            run(model, ROWS, tmp_path, "a.parquet", **change)
        assert next(iter(change)) in str(info.value)
    shuffled = ROWS[1:] + ROWS[:1]
    with pytest.raises(InputError, match="row 0's prompt .* not read in the same order"):
        run(model, shuffled, tmp_path, "a.parquet")
    meta = json.loads((tmp_path / "a.parquet" / parquet.META).read_text())
    assert meta["by"] == "block" and meta["target"] == "column 'answer'" and len(meta["labels"]) > 3
    (tmp_path / "file.parquet").write_text("not a directory")
    with pytest.raises(InputError, match="is a file"):
        run(model, ROWS, tmp_path, "file.parquet")
    # shorter data on the same out=: the rows written from the longer data are not this data's rows
    with pytest.raises(InputError, match="the data has 4 row.*up to 5: they were written from other data"):
        run(model, ROWS[:4], tmp_path, "a.parquet")
    options = {"target": "answer", "contrast": "foil", "batch_size": BATCH, "progress": False, "reduce": "stats",
               "out": tmp_path / "stats"}
    dla_recipes.attribute_dataset(model, ROWS[:6], **options)
    with pytest.raises(InputError, match="the data has 4 row"):  # the statistics saved there too
        dla_recipes.attribute_dataset(model, ROWS[:4], **options)


def test_a_malformed_dataset_names_every_bad_row_and_column(model, tmp_path):
    bad = [dict(r) for r in ROWS[:6]]
    bad[1]["prompt"] = 3.5
    del bad[2]["answer"]
    bad[3]["answer"] = ""
    bad[5]["foil"] = None
    with pytest.raises(InputError) as info:
        run(model, bad, tmp_path, batch_size=8)
    text = str(info.value)
    for row, column in ((1, "prompt"), (2, "answer"), (3, "answer"), (5, "foil")):
        assert f"row {row}" in text and repr(column) in text, (row, column, text)
    assert "4 malformed" in text and "row 0" not in text and "row 4" not in text
    assert not list((tmp_path / "rows.parquet").glob("part-*"))  # nothing ran: the first chunk was bad
    floats = pd.DataFrame(ROWS).assign(score=[0.5 + i for i in range(len(ROWS))])
    with pytest.raises(InputError, match=r"row 0, column 'score': a float \(0.5\)") as info:
        dla_recipes.attribute_dataset(model, floats, target="score")
    assert "row 10, column 'score'" in str(info.value)
    with pytest.raises(InputError, match="no column 'question'.*'prompt'"):
        dla_recipes.attribute_dataset(model, pd.DataFrame(ROWS), prompt="question", target="answer")
    with pytest.raises(InputError, match=r"no column ' Mary'.*Same\(' Mary'\)"):  # a literal, read as a column
        dla_recipes.attribute_dataset(model, pd.DataFrame(ROWS), target=" Mary")
    with pytest.raises(InputError, match="row 0: no column 'target'"):
        dla_recipes.attribute_dataset(model, ROWS)  # the default target column is "target"
    with pytest.raises(InputError, match="row 4: a str"):
        dla_recipes.attribute_dataset(model, [*ROWS[:4], "w5 w6"], target="answer")
    # a generator is checked as it is read: the chunks before the bad one ran and were written
    late = [*ROWS[:8], {"prompt": None, "answer": "w20", "foil": 40}]
    with pytest.raises(InputError, match="row 8, column 'prompt': a NoneType"):
        run(model, iter(late), tmp_path, "late.parquet")
    assert sorted(pd.read_parquet(tmp_path / "late.parquet")["row"]) == list(range(8))


def test_one_value_for_every_row_keywords_and_token_ids(model, tmp_path):
    prompts = [r["prompt"] for r in ROWS]
    same = dla_recipes.attribute_dataset(model, ROWS, target=Same("w20"), contrast="mean", batch_size=BATCH)
    assert same == dla_recipes.attribute(model, prompts, "w20", contrast="mean", batch_size=BATCH)
    ids = [{"ids": model.tokenizer(p)["input_ids"], "next": "w30"} for p in prompts]
    nxt = dla_recipes.attribute_dataset(model, ids, prompt="ids", target="next", position="all", batch_size=BATCH)
    expected = dla_recipes.attribute(model, [r["ids"] for r in ids], "next", position="all", batch_size=BATCH)
    assert nxt == expected
    column = dla_recipes.attribute_dataset(model, ids, prompt="ids", target=Column("next"), batch_size=BATCH)
    assert set(column.target_tokens) == {"w30"}


def test_a_remote_failure_keeps_the_finished_chunks_and_says_how_to_resume(model, tmp_path, monkeypatch):
    whole = run(model, ROWS, tmp_path, "whole.parquet")
    real, calls = dla_datasets.attribute_logits, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RemoteError("request failed") from ConnectionError("server restarting")
        return real(*args, **kwargs)

    monkeypatch.setattr(dla_datasets, "attribute_logits", flaky)
    with pytest.raises(RemoteBatchError, match="attribute_dataset again with the same out=") as info:
        run(model, ROWS, tmp_path, "flaky.parquet")
    error = info.value
    assert error.done == tuple(range(BATCH)) and error.failed_batch == 1 and error.resumable
    assert sorted(pd.read_parquet(tmp_path / "flaky.parquet")["row"]) == list(range(BATCH))
    error.resume()
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "flaky.parquet"), whole, check_exact=True)


# -- reduce="stats": chunks merged (AttributionStats.merge), saved in out= after each chunk, resumable ---------------

def by_hand(frame, labels):
    x = frame[labels].to_numpy(dtype="float64")
    return x.mean(0), x.std(0, ddof=1)


def test_stats_over_chunks_are_the_rows_statistics_and_one_call(model, tmp_path):
    stats = dla_recipes.attribute_dataset(model, iter(ROWS), target="answer", contrast="foil", by="head",
                                          reduce=dla_recipes.Stats(replicates=64, seed=3), batch_size=BATCH,
                                          progress=False)
    frame = run(model, ROWS, tmp_path, by="head")
    labels = components(frame)
    assert list(stats.labels) == labels and stats.n == len(ROWS)
    table = stats.summary()
    mean, std = by_hand(frame, labels)
    mean_bound, _, std_bound = bounds.moments_bound(frame[labels].to_numpy(dtype="float64"))  # float64, both sides
    assert float((abs(table["mean"].to_numpy()[:len(labels)] - mean) / mean_bound.numpy()).max()) <= 1
    assert float((abs(table["std"].to_numpy()[:len(labels)] - std) / std_bound.numpy()).max()) <= 1
    one = dla_recipes.attribute(model, [r["prompt"] for r in ROWS], [r["answer"] for r in ROWS],
                                contrast=[r["foil"] for r in ROWS], by="head", batch_size=BATCH,
                                reduce=dla_recipes.Stats(replicates=64, seed=3))
    assert torch.equal(stats.weight, one.weight)  # the same Poisson weights: sample indices follow the data's rows
    for name in ("mean", "m2", "boot", "flip", "positive"):
        assert torch.equal(getattr(stats, name), getattr(one, name)), name
    with pytest.raises(TypeError, match="replicates"):  # Stats' fields are Stats(...)'s: no option swallows them
        dla_recipes.attribute_dataset(model, ROWS, target="answer", replicates=8)


def test_stats_resume_from_the_last_chunk_saved(model, tmp_path):
    options = {"target": "answer", "contrast": "foil", "reduce": "stats", "batch_size": BATCH, "progress": False}
    whole = dla_recipes.attribute_dataset(model, ROWS, **options)
    out = tmp_path / "stats"
    with pytest.raises(Killed):
        dla_recipes.attribute_dataset(model, dies_after(ROWS, 9), out=out, **options)
    saved, rows = dla_datasets.load_stats(out)
    assert rows == 8 and saved.n == 8 and [p.name for p in out.glob("stats-*.pt")] == ["stats-000000000008.pt"]
    with pytest.raises(InputError, match="row 7's prompt .* not read in the same order"):
        dla_recipes.attribute_dataset(model, ROWS[1:] + ROWS[:1], out=out, **options)
    resumed = dla_recipes.attribute_dataset(model, ROWS, out=out, **options)
    for name in ("count", "mean", "m2", "boot", "weight", "flip", "positive"):
        assert torch.equal(torch.as_tensor(getattr(resumed, name)), torch.as_tensor(getattr(whole, name))), name
    assert torch.equal(dla_datasets.load_stats(out)[0].mean, whole.mean)
    with pytest.raises(InputError, match="written by a different call"):
        dla_recipes.attribute_dataset(model, ROWS, out=out, **{**options, "reduce": dla_recipes.Stats(seed=1)})


def test_compare_a_second_prompt_column_and_an_edit(model, tmp_path):
    paired = [{**r, "corrupt": ROWS[(i + 3) % len(ROWS)]["prompt"]} for i, r in enumerate(ROWS)]
    stats = dla_recipes.attribute_dataset(model, paired, target="answer", contrast="foil", reduce="stats",
                                          compare="corrupt", batch_size=BATCH, progress=False)
    clean = run(model, paired, tmp_path, "clean.parquet")
    corrupt = run(model, [{**r, "prompt": r["corrupt"]} for r in paired], tmp_path, "corrupt.parquet")
    labels = components(clean)
    diff = clean[labels].to_numpy(dtype="float64") - corrupt[labels].to_numpy(dtype="float64")
    assert stats.paired and stats.n == len(ROWS)
    # the pairs run in other batches (clean + corrupted padded together): each row within both batchings' rounding
    # of its logit (row_limits), clean and corrupt, averaged; plus the float64 means (measured before: 3.3e-9)
    limit = (row_limits(model, clean) + row_limits(model, corrupt)).mean() + bounds.moments_bound(diff).mean.max()
    assert float(abs(stats.summary()["mean"].to_numpy()[:len(labels)] - diff.mean(0)).max()) <= float(limit)

    hs = dla_recipes.head_slice(model, 1, 1)

    def ablate(m):
        hs.site(m).input[hs.index] = 0

    edited = dla_recipes.attribute_dataset(model, ROWS, target="answer", contrast="foil", by="head", reduce="stats",
                                           intervene=ablate, compare=dla_datasets.Versus(intervene=None),
                                           batch_size=BATCH, progress=False)
    plain = run(model, ROWS, tmp_path, "plain.parquet", by="head")
    ablated = dla_recipes.attribute(model, [r["prompt"] for r in ROWS], [r["answer"] for r in ROWS],
                                    contrast=[r["foil"] for r in ROWS], by="head", intervene=ablate,
                                    batch_size=BATCH)
    table = edited.summary()
    # the ablated head, 0 - its plain part: the plain rows within both batchings' rounding (row_limits), averaged,
    # plus the float64 means (measured before: 1.4e-10 on AVX2, 1.0e-9 on an AVX-512 / AMX Xeon, one float32 ulp)
    part = plain["L1.H1"].to_numpy(dtype="float64")
    limit = row_limits(model, plain).mean() + bounds.moments_bound(part[:, None]).mean[0]
    assert abs(table.loc["L1.H1", "mean"] + part.mean()) <= float(limit)
    logit = ablated.logit.double().numpy() - plain["logit"].to_numpy(dtype="float64")
    # the same logits (the same batches), two float64 means of them (moments_bound; measured before: 1.7e-18)
    assert abs(table.loc["logit", "mean"] - logit.mean()) <= float(bounds.moments_bound(logit[:, None]).mean[0])
    assert "L1.attn.edit" in edited.labels  # a column only the edited pass has: 0 in the plain one
    with pytest.raises(InputError, match="with reduce='stats'"):
        dla_recipes.attribute_dataset(model, paired, target="answer", compare="corrupt")


# -- remote: the loopback NDIF server, one request a chunk ------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import serve_tiny

    with serve_tiny(tmp_path_factory.mktemp("served_datasets"), [FAMILY]) as running:
        yield running


@pytest.mark.server
def test_remote_rows_and_stats_equal_local(server, tmp_path):
    """Rows streamed to Parquet and statistics, one remote request a chunk, equal the local run (single-threaded,
    as the server computes)."""
    from conftest import single_threaded

    remote_model, local_model = server.remote_model(FAMILY), server.local_model(FAMILY)
    with server.client():
        remote = run(remote_model, ROWS, tmp_path, "remote.parquet", by="head", remote=True)
        remote_stats = dla_recipes.attribute_dataset(remote_model, ROWS, target="answer", contrast="foil", by="head",
                                                     reduce="stats", batch_size=BATCH, remote=True, progress=False)
    with single_threaded():
        local = run(local_model, ROWS, tmp_path, "local.parquet", by="head")
        local_stats = dla_recipes.attribute_dataset(local_model, ROWS, target="answer", contrast="foil", by="head",
                                                    reduce="stats", batch_size=BATCH, progress=False)
    labels = components(local)
    assert components(remote) == labels and remote["row"].tolist() == local["row"].tolist()
    assert (remote[labels].to_numpy() == local[labels].to_numpy()).all()
    # the model's own logit: lm_head on a strided input, its last bits may differ between two processes (test_remote):
    # within both computations' rounding of it (row_limits)
    gap = torch.tensor(abs(remote["logit"].to_numpy() - local["logit"].to_numpy()))
    assert float((gap / row_limits(local_model, local)).max()) <= 1
    assert torch.equal(remote_stats.weight, local_stats.weight) and remote_stats.n == local_stats.n
    n = len(labels)
    assert torch.equal(remote_stats.mean[:n], local_stats.mean[:n]) and torch.equal(remote_stats.boot[:, :n],
                                                                                    local_stats.boot[:, :n])


def test_progress_sum_rows_and_a_missing_pyarrow(model, tmp_path, capsys, monkeypatch):
    run(model, ROWS, tmp_path, "bar.parquet", progress=None)  # 3 chunks: a bar of prompts, its rate
    assert "prompt/s" in capsys.readouterr().err
    run(model, ROWS[:BATCH], tmp_path, "one.parquet", progress=None)  # one chunk: no bar
    assert "prompt" not in capsys.readouterr().err
    summed = run(model, ROWS, tmp_path, "sum.parquet", target="next", contrast=None, position="all", reduce="sum")
    expected = dla_recipes.attribute(model, [r["prompt"] for r in ROWS], "next", position="all", reduce="sum",
                                     batch_size=BATCH)
    assert "position" not in summed and "contrast" not in summed
    assert torch.equal(torch.tensor(summed[expected.labels].to_numpy()), expected.values)
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(InputError, match=r"pip install dla_recipes\[data\]"):
        run(model, ROWS, tmp_path, "no_pyarrow.parquet")
