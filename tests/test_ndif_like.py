"""Remote attribution on the loopback server run as NDIF runs a request (``LoopbackServer(ndif=True)``): the model in
bfloat16 with sdpa attention, every request inside ``torch.autocast("cpu", bfloat16)`` (NDIF's
``torch.autocast("cuda", ...)`` bracket, on the CPU); many batches in one NDIF session, cut under the job limit;
``blocking=False`` handles, resumed after the server restarts; the client's nnsight against the server's.

Remote equals local bit for bit: the local model is the same bfloat16 sdpa model (``server.local_model``), run
single-threaded under the same bracket (``server.bracket()``). The parts sum to the model's own logit difference,
each prompt alone in a plain transformers forward under the same bracket.
"""

import secrets

import nnsight
import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, single_threaded

import dla_recipes
from dla_recipes import InputError, RemoteError
from dla_recipes.testing import tiny
from dla_recipes.testing.loopback import LoopbackServer
from dla_recipes.transport import session, versions
from dla_recipes.transport.session import JobLimit

pytestmark = pytest.mark.server

SERVED = ["llama", "gpt2", "mixtral"]  # RMSNorm/GQA, LayerNorm + Conv1D, routed experts
CASES = [("llama", "block"), ("llama", "head"), ("llama", "neuron"), ("gpt2", "head"), ("gpt2", "neuron"),
         ("mixtral", "expert"), ("mixtral", "neuron")]
# |parts sum - the model's own logit difference|, each prompt alone, bfloat16 under the bracket: two forwards (the
# padded batch, the prompt alone), each within the self-check's bound of its own rounding (selfcheck.py's model:
# each logit's half ulp, the final norm's output and the stream's adds as independent roundings, read from the
# call's diagnostics["bound"]): twice that. Measured before: 2.0e-3 of max(1, |logit|) at most (llama, by="head").
PROMPTS6 = [f"w{i} w{i + 1} w{i + 2}" + " w3" * (i % 3) for i in range(6)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Folders served as NDIF serves them (bfloat16, sdpa, autocast), clients older than this one refused. llama and
    gpt2 are saved in float32 (the server casts them), mixtral in bfloat16: a float32 MoE model built without
    weights (the remote client's) fails nnterp's scan of its fused experts on the CPU."""
    root = tmp_path_factory.mktemp("served")
    folders = {}
    for family in SERVED:
        folders[family] = str(root / family)
        tiny.build(family).to(torch.bfloat16 if family == "mixtral" else torch.float32).save_pretrained(
            folders[family])
        tiny.tokenizer().save_pretrained(folders[family])
    with LoopbackServer(folders, api_key=secrets.token_hex(16), ndif=True, forked=True,
                        min_nnsight_version=versions.client_nnsight()) as running:
        yield running


_MODELS: dict = {}


def models(server, family):
    if family not in _MODELS:
        _MODELS[family] = server.remote_model(family), server.local_model(family, dispatch=True)
    return _MODELS[family]


def local_run(server, call):
    with single_threaded(), server.bracket():
        return call()


def assert_identical(remote, local):
    assert remote.labels == local.labels
    assert torch.equal(remote.values, local.values), float((remote.values - local.values).abs().max())
    assert torch.equal(remote.constant, local.constant)
    assert torch.equal(remote.logit, local.logit)


def logit_difference(model, prompt: str, bracket) -> float:
    """Target minus contrast at the last token of ``prompt`` alone: a plain transformers forward under ``bracket``."""
    ids = model.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad(), bracket():
        logits = model._module(**ids).logits[0, -1].double()
    target, contrast = (model.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (TARGET, CONTRAST))
    return float(logits[target] - logits[contrast])


def test_the_server_runs_as_ndif(server):
    """bfloat16 weights, sdpa attention, and a tensor the request makes is bfloat16: the bracket is on."""
    remote, local = models(server, "llama")
    assert next(local._module.parameters()).dtype == torch.bfloat16
    assert local._module.config._attn_implementation == "sdpa"
    assert "(torch.bfloat16, sdpa attention, autocast on)" in server.log_tail(200)
    with server.client(), torch.no_grad(), remote.trace(PROMPTS[0], remote=True):
        made = (torch.ones(2, 2) @ torch.ones(2, 2)).save()
    assert made.dtype == torch.bfloat16


@pytest.mark.parametrize("family,by", CASES)
def test_remote_equals_local(server, family, by):
    remote_model, local_model = models(server, family)
    with server.client():
        remote = dla_recipes.attribute(remote_model, PROMPTS, TARGET, contrast=CONTRAST, by=by, remote=True)
    local = local_run(server, lambda: dla_recipes.attribute(local_model, PROMPTS, TARGET, contrast=CONTRAST, by=by))
    assert_identical(remote, local)
    reference = torch.tensor([logit_difference(local_model, p, server.bracket) for p in PROMPTS])
    gap = (remote.total - reference).abs()
    assert float((gap / (2 * remote.diagnostics["bound"])).max()) <= 1, (gap, reference)  # both forwards' (above)
    assert all(p.device.type == "meta" for p in remote_model._module.parameters())


@pytest.mark.parametrize("by", ["block", "head"])
def test_remote_equals_local_with_intervene(server, by):
    """A head ablated by ``intervene=`` travels with the session: remote equals local, and its part is 0."""
    remote_model, local_model = models(server, "llama")

    def ablate(model):
        model.layers[1].self_attn.o_proj.input[:, :, 0:16] = 0  # head 0 of block 1 (head_dim 16)

    def call(model, remote):
        return dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by, remote=remote, batch_size=2,
                                     intervene=ablate, progress=False)

    with server.client():
        remote = call(remote_model, True)
    local = local_run(server, lambda: call(local_model, False))
    assert_identical(remote, local)
    if by == "head":
        assert bool((remote.values[:, remote.labels.index("L1.H0")] == 0).all())


# -- many batches in one NDIF session, cut under the job limit -------------------------------------------------------


def test_batches_travel_in_one_session(server, monkeypatch):
    """Six batches with an estimate that fits them in one job: one request, and the answer of six local traces."""
    monkeypatch.setattr(session, "JOB_LIMIT", JobLimit(batch_seconds=1.0))
    remote_model, local_model = models(server, "gpt2")
    server.clear_stats()
    with server.client():
        remote = dla_recipes.attribute(remote_model, PROMPTS6, TARGET, by="head", remote=True, batch_size=1)
    assert [r["status"] for r in server.stats()] == ["COMPLETED"]
    local = local_run(server, lambda: dla_recipes.attribute(local_model, PROMPTS6, TARGET, by="head", batch_size=1))
    assert_identical(remote, local)


@pytest.mark.parametrize("limit,sizes", [
    (JobLimit(seconds=10.0, margin=0.5, batch_seconds=2.0), [2, 2, 2]),  # 5 s a job, 2 s a batch: 2 batches a job
    (JobLimit(max_batches=4, batch_seconds=0.1), [4, 2]),
    (JobLimit(), [1, 5]),  # nothing estimated: one batch measures it, the rest fit in one job
])
def test_sessions_are_cut_under_the_job_limit(server, monkeypatch, limit, sizes):
    sent = []
    real = session.send_session

    def send(model, plan, batches, calls, remote, intervene=None):
        sent.append(len(batches))
        return real(model, plan, batches, calls, remote, intervene)

    monkeypatch.setattr(session, "JOB_LIMIT", limit)
    monkeypatch.setattr(session, "send_session", send)
    remote_model, local_model = models(server, "llama")
    with server.client():
        remote = dla_recipes.attribute(remote_model, PROMPTS6, TARGET, remote=True, batch_size=1, progress=False)
    assert sent == sizes
    local = local_run(server, lambda: dla_recipes.attribute(local_model, PROMPTS6, TARGET, batch_size=1))
    assert_identical(remote, local)


# -- blocking=False: a handle ----------------------------------------------------------------------------------------


def test_blocking_false_returns_a_handle(server):
    remote_model, local_model = models(server, "llama")
    with server.client():
        job = dla_recipes.attribute(remote_model, PROMPTS6, TARGET, by="head", remote=True, batch_size=2,
                                    blocking=False)
        assert isinstance(job, dla_recipes.transport.handle.RemoteJob) and len(job.job_ids) == 1
        remote = job.result(timeout=120)
        assert job.status() == "COMPLETED" and job.result() is remote
    local = local_run(server, lambda: dla_recipes.attribute(local_model, PROMPTS6, TARGET, by="head", batch_size=2))
    assert_identical(remote, local)


def test_blocking_false_needs_remote():
    with pytest.raises(InputError, match="blocking=False.*needs remote"):
        dla_recipes.attribute("unused", PROMPTS, TARGET, blocking=False)


# -- the client's nnsight against the server's ------------------------------------------------------------------------


def test_a_client_nnsight_unlike_the_servers_is_a_clear_error(server, monkeypatch):
    remote_model, _ = models(server, "llama")
    monkeypatch.setattr(versions, "client_nnsight", lambda: "0.7.0")
    server.clear_stats()
    with server.client(), pytest.raises(RemoteError, match=(
            rf"this client has nnsight 0\.7\.0, the NDIF server at {server.url} runs nnsight "
            rf"{nnsight.__version__}.*pip install nnsight=={nnsight.__version__}")):
        dla_recipes.attribute(remote_model, PROMPTS, TARGET, remote=True)
    assert server.stats() == []  # refused before anything was sent


def test_the_server_refuses_an_older_nnsight_with_ndifs_own_check(server, monkeypatch):
    """ndif's ``validate_client_versions`` (NDIF_MIN_NNSIGHT_VERSION) refuses the request: a RemoteError says so."""
    from nnsight.intervention.backends import remote as nnsight_remote

    remote_model, _ = models(server, "llama")
    monkeypatch.setattr(nnsight_remote, "_NNSIGHT_VERSION", "0.1.0")  # what the nnsight-version header says
    with server.client(), pytest.raises(RemoteError, match=(
            r"refused this client's nnsight: .*Client nnsight version 0\.1\.0 is below the minimum supported "
            rf"{nnsight.__version__}")):
        dla_recipes.attribute(remote_model, PROMPTS, TARGET, remote=True)
    assert server.stats()[-1]["http_status"] == 400


# last: it restarts the server


def test_a_handle_resumed_after_the_server_restarts(server):
    """The server forgets every job when it restarts: the handle says LOST, result() says to resume, and resume()
    sends the jobs again and completes, equal to the local run."""
    remote_model, local_model = models(server, "gpt2")
    with server.client():
        job = dla_recipes.attribute(remote_model, PROMPTS6, TARGET, contrast=CONTRAST, by="neuron", remote=True,
                                    batch_size=2, blocking=False)
        first = job.job_ids
        server.restart()
        assert job.status() == "LOST"
        with pytest.raises(RemoteError, match=r"(?s)did not complete \(LOST\).*does not know job.*call \.resume\(\)"):
            job.result()
        remote = job.resume().result(timeout=120)
    assert job.job_ids != first and job.status() == "COMPLETED"
    local = local_run(server, lambda: dla_recipes.attribute(local_model, PROMPTS6, TARGET, contrast=CONTRAST,
                                                            by="neuron", batch_size=2))
    assert_identical(remote, local)
