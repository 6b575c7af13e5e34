"""Remote attribution through a real NDIF server process (the loopback server), against local runs.

The server (``dla_recipes.testing.loopback``) runs the ``ndif`` package's own request execution code in a
separate process that has neither dla_recipes nor nnterp installed, so the recipe must travel by value. Remote must
equal local to 0.0 (both single-threaded; the model's own logit to the last bit of one matmul), and only the
attribution's few numbers may come back.
"""


import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, serve_tiny, single_threaded, tiny_model
from test_positions import attribution_bound, batch_ratio, difference

import dla_recipes
from dla_recipes import RemoteError
from dla_recipes.testing import tiny
from dla_recipes.testing.loopback import free_port
from dla_recipes.trace.reading import Where
from dla_recipes.transport import reuse

pytestmark = pytest.mark.server

SERVED = ["gpt2", "llama", "gemma2"]  # a LayerNorm + Conv1D family, an RMSNorm/GQA family, a sandwich-norm family
# issue 12's term kinds on a model built without weights: norms on the stream (MiniMax), post-norm blocks and no final
# norm (OpenAI GPT), norms without weights and a final norm that also runs before the blocks (nanochat)
SERVED += ["minimax", "openai_gpt", "nanochat"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    with serve_tiny(root, SERVED) as running:
        yield running


@pytest.mark.parametrize("by", ["block", "head", "neuron"])
@pytest.mark.parametrize("family", SERVED)
def test_remote_equals_local(server, family, by):
    remote_model, local_model = server.remote_model(family), server.local_model(family)
    with server.client():
        remote = dla_recipes.attribute(remote_model, PROMPTS, TARGET, contrast=CONTRAST, by=by, remote=True)
    with single_threaded():
        local = dla_recipes.attribute(local_model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
    assert remote.labels == local.labels
    assert torch.equal(remote.values, local.values), float((remote.values - local.values).abs().max())
    assert torch.equal(remote.constant, local.constant)
    # The model's own logit comes from lm_head on the kept positions (logits_to_keep): for a batch that matmul runs
    # on a strided input, and MKL's result for it can differ in the last bits between two processes (measured: at
    # most 1.2e-7 on identical inputs, 0.0 for one prompt): within both computations' rounding of the logit
    # (test_positions.attribution_bound). The attribution itself is bit-identical.
    limit = attribution_bound(tiny_model(family), local, difference(tiny_model(family)))
    assert batch_ratio(remote.logit, local.logit, limit) <= 1
    assert remote.error <= 1e-4 * max(1.0, float(remote.logit.abs().max()))
    # the remote model never loaded its weights: everything ran server side, and the client kept no record for it
    assert all(p.device.type == "meta" for p in remote_model._module.parameters())
    assert reuse._STORES.get(remote_model._module) is None


def test_remote_by_url(server):
    """``remote="http://127.0.0.1:PORT"`` names the server directly (the key still comes from nnsight's config)."""
    model = server.remote_model("llama")
    with server.client():
        by_url = dla_recipes.attribute(model, PROMPTS[0], TARGET, remote=server.url)
        by_config = dla_recipes.attribute(model, PROMPTS[0], TARGET, remote=True)
    assert torch.equal(by_url.values, by_config.values)


@pytest.mark.parametrize("prompt_words", [3, 60])
def test_result_bytes_stay_small(server, prompt_words):
    """The result is the attribution's tensor: under 1 KB + 8 B per component, whatever the prompt length."""
    model = server.remote_model("llama")
    prompt = " ".join(f"w{i % 100}" for i in range(prompt_words))
    server.clear_stats()
    with server.client():
        attr = dla_recipes.attribute(model, prompt, TARGET, remote=True)
    record = server.stats()[-1]
    assert record["status"] == "COMPLETED"
    bound = 1024 + 8 * len(attr.labels)
    assert record["result_bytes"] <= bound, record


def test_many_prompts_in_batches_with_progress(server, capsys):
    model = server.remote_model("gpt2")
    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(6)]
    server.clear_stats()
    with server.client():
        chunked = dla_recipes.attribute(model, prompts, TARGET, remote=True, batch_size=2, progress=True)
        whole = dla_recipes.attribute(model, prompts, TARGET, remote=True)
    # three batches in two NDIF sessions (the first batch alone measures how long one takes, the other two fit in
    # one job), then one request for all six
    assert [r["status"] for r in server.stats()] == ["COMPLETED"] * 3
    t = model.tokenizer.convert_tokens_to_ids(TARGET)  # each batching's rounding of each logit (attribution_bound)
    limit = attribution_bound(tiny_model("gpt2"), whole, lambda b, p, z: z[p, t])
    assert batch_ratio(chunked.values, whole.values, limit) <= 1
    assert "DLA by block" in capsys.readouterr().err


# -- errors: each names its cause, and nothing falls back to a local computation ------------------------------------


def test_wrong_api_key(server):
    model = server.remote_model("llama")
    with server.client(api_key="not-the-key"), pytest.raises(RemoteError, match=r"refused the API key.*Invalid API key"):
        dla_recipes.attribute(model, PROMPTS[0], TARGET, remote=True)


def test_missing_api_key(server):
    model = server.remote_model("llama")
    with server.client(api_key=None), pytest.raises(RemoteError, match=r"refused the API key.*Missing API key"):
        dla_recipes.attribute(model, PROMPTS[0], TARGET, remote=True)


def test_unreachable_server(server):
    model = server.remote_model("llama")
    closed = f"http://127.0.0.1:{free_port()}"
    with server.client(), pytest.raises(RemoteError, match=rf"cannot reach the NDIF server at {closed}"):
        dla_recipes.attribute(model, PROMPTS[0], TARGET, remote=closed)


def test_model_not_hosted(server, tmp_path):
    from dla_recipes.testing.loopback import standardized_model

    folder = tmp_path / "other"
    tiny.build("llama").save_pretrained(folder)
    tiny.tokenizer().save_pretrained(folder)
    model = standardized_model(folder, remote=True, name="not-served")
    with server.client(), pytest.raises(RemoteError, match=r"does not host this model.*not-served"):
        dla_recipes.attribute(model, PROMPTS[0], TARGET, remote=True)


def test_server_side_exception(server):
    """An exception inside the remote trace comes back as a RemoteError naming it (here an out-of-range position)."""
    from dla_recipes.transport.batches import prepare
    from dla_recipes.transport.run import run_trace

    model = server.remote_model("llama")
    batch = prepare(model, PROMPTS[0], TARGET)
    object.__setattr__(batch, "positions", torch.tensor([999]))  # bypass the client-side check on purpose
    # the site reads gather with index_select, whose IndexError reads "index out of range in self"
    with server.client(), pytest.raises(RemoteError, match=r"failed on the NDIF server at .*: IndexError: index "
                                        r"(999 is out of bounds|out of range in self)"):
        plan = dla_recipes.plan.build_plan(model)
        call = dla_recipes.trace.LogitCall(plan, Where(batch.positions, batch.rows), batch.targets)
        run_trace(model, plan, batch, call, remote=True)


# -- transient failures are retried; a batch that fails for good keeps what completed --------------------------------


def test_a_transient_failure_is_retried(server, monkeypatch):
    """A 503 (a deployment restarting) is retried; the answer equals a run that never failed."""
    from dla_recipes.transport import remote as remote_module

    monkeypatch.setattr(remote_module, "BACKOFF_S", 0.01)
    model = server.remote_model("llama")
    with server.client():
        clean = dla_recipes.attribute(model, PROMPTS, TARGET, remote=True)
        server.clear_stats()
        server.make_unavailable(2)  # the first two sends fail, the third (RETRIES = 2) goes through
        retried = dla_recipes.attribute(model, PROMPTS, TARGET, remote=True)
    assert [r["http_status"] for r in server.stats()] == [503, 503, 200]
    assert torch.equal(retried.values, clean.values)


def one_request_a_batch(monkeypatch, before=None):
    """One NDIF session a batch (``JobLimit(max_batches=1)``); ``before(batches)`` runs before each is sent.
    Returns the list of the prompts of each request sent."""
    from dla_recipes.transport import session

    sent = []
    real = session.send_session

    def send(model, plan, batches, calls, remote, intervene=None):
        sent.append(batches[0].prompts)
        if before is not None:
            before(len(sent))
        return real(model, plan, batches, calls, remote, intervene)

    monkeypatch.setattr(session, "JOB_LIMIT", session.JobLimit(max_batches=1))
    monkeypatch.setattr(session, "send_session", send)
    return sent


def test_a_failed_request_keeps_the_completed_ones_and_resumes(server, monkeypatch):
    from dla_recipes import RemoteBatchError
    from dla_recipes.transport import remote as remote_module

    monkeypatch.setattr(remote_module, "BACKOFF_S", 0.01)
    model = server.remote_model("gpt2")
    prompts = [f"w{i} w{i + 1} w{i + 2}" + " w3" * (i % 2) for i in range(6)]

    def before(count):  # make request 2 of 3 fail for good: three 503s in a row
        if count == 2:
            server.make_unavailable(remote_module.RETRIES + 1)

    sent = one_request_a_batch(monkeypatch, before)
    with server.client():
        whole = dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, remote=True)
        sent.clear()
        with pytest.raises(RemoteBatchError, match=r"(?s)request 2 of 3 failed.*unavailable.*\.resume\(\)") as failure:
            dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, remote=True, batch_size=2)
        error = failure.value
        assert error.done == (0, 1) and error.failed_batch == 1
        assert error.partial.prompts == tuple(prompts[:2])
        limit = attribution_bound(tiny_model("gpt2"), whole, difference(tiny_model("gpt2")))  # both batchings'
        assert batch_ratio(error.partial.values, whole.values[:2], limit[:2]) <= 1
        resumed = error.resume()  # sends requests 2 and 3 only
    assert sent[-2:] == [tuple(prompts[2:4]), tuple(prompts[4:6])] and len(sent) == 4
    assert resumed.prompts == tuple(prompts)
    assert batch_ratio(resumed.values, whole.values, limit) <= 1
    assert batch_ratio(resumed.logit, whole.logit, limit) <= 1


def test_a_failure_no_retry_fixes_offers_no_resume(server, monkeypatch):
    """Request 2 of 3 refused for good (a wrong key): the completed request is kept, but no .resume() is offered, and
    calling it says why instead of sending the request again."""
    from nnsight import CONFIG

    from dla_recipes import RemoteBatchError

    model = server.remote_model("gpt2")
    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(6)]

    def before(count):
        if count == 2:
            CONFIG.API.APIKEY = "not-the-key"  # server.client() restores the key after the block

    sent = one_request_a_batch(monkeypatch, before)
    with server.client():
        with pytest.raises(RemoteBatchError, match=r"(?s)request 2 of 3 failed.*refused the API key") as failure:
            dla_recipes.attribute(model, prompts, TARGET, remote=True, batch_size=2)
        error = failure.value
        assert error.partial.prompts == tuple(prompts[:2]) and not error.resumable
        assert "no .resume()" in str(error) and "call .resume()" not in str(error)
        with pytest.raises(RemoteError, match="no retry fixes"):
            error.resume()
    assert len(sent) == 2  # nothing was sent again


def test_a_first_request_that_fails_for_good_is_its_remote_error(server, tmp_path):
    """A model built on an unregistered local folder (not through load, which refuses it) fails on the client: the
    RemoteError itself, no RemoteBatchError offering to resume a request that would fail the same way."""
    from nnterp import StandardizedTransformer

    from dla_recipes import RemoteBatchError
    from dla_recipes.testing.loopback import load_tokenizer

    folder = tmp_path / "unregistered"
    tiny.build("llama").save_pretrained(folder)
    tiny.tokenizer().save_pretrained(folder)
    model = StandardizedTransformer(str(folder.absolute()), remote=True, tokenizer=load_tokenizer(folder))
    with server.client(), pytest.raises(RemoteError, match="named by the hub id the server hosts") as failure:
        dla_recipes.attribute(model, PROMPTS[0], TARGET, remote=True)
    assert not isinstance(failure.value, RemoteBatchError) and "resume" not in str(failure.value)


def test_load_refuses_a_remote_model_from_a_local_folder(tmp_path, monkeypatch):
    """``load(folder, remote=True)`` fails at load, not at the first attribute: a remote model is named by a hub id."""
    folder = tmp_path / "tiny-llama"
    tiny.build("llama").save_pretrained(folder)
    tiny.tokenizer().save_pretrained(folder)
    with pytest.raises(dla_recipes.InputError, match=r"with remote=True is a local folder.*hub id the server hosts"):
        dla_recipes.load(str(folder), remote=True)
    with pytest.raises(dla_recipes.InputError, match=r"short name.*load\('HuggingFaceTB/SmolLM2-135M-Instruct'"):
        dla_recipes.load("smollm2", remote=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(dla_recipes.InputError, match=r"hub is offline \(HF_HUB_OFFLINE is set\)"):
        dla_recipes.load("meta-llama/Llama-3.1-8B", remote=True)
    assert dla_recipes.load(str(folder)).to_model_key  # the folder itself loads, locally


def test_errors_that_would_fail_again_are_not_retried(server):
    """A wrong key is final: one send, no retry."""
    model = server.remote_model("llama")
    server.clear_stats()
    with server.client(api_key="not-the-key"), pytest.raises(RemoteError, match="refused the API key"):
        dla_recipes.attribute(model, PROMPTS[0], TARGET, remote=True)
    assert [r["http_status"] for r in server.stats()] == [403]


def test_transient_classification():
    import httpx

    from dla_recipes.transport.remote import is_transient

    request = httpx.Request("POST", "http://127.0.0.1:1/request")

    def status(code):
        error = httpx.HTTPStatusError("x", request=request, response=httpx.Response(code, request=request))
        wrapped = RemoteError("Failed to send request")
        wrapped.__cause__ = error
        return wrapped

    assert is_transient(status(503)) and is_transient(status(502)) and is_transient(ConnectionRefusedError())
    assert is_transient(httpx.ConnectError("refused")) and is_transient(TimeoutError())
    assert not is_transient(status(403)) and not is_transient(status(404)) and not is_transient(status(413))
    assert not is_transient(IndexError("index 999 is out of bounds"))
