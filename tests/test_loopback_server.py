"""The loopback NDIF server (dla_recipes.testing.loopback) against nnsight 0.8's real remote client.

One server per module (a subprocess on a free 127.0.0.1 port) serving a tiny random Llama and GPT-2. Checks: remote
traces through nnterp's StandardizedTransformer equal local ones exactly, the byte/time stats are real, small saves
move few bytes, and every failure (wrong/missing key, closed port, unhosted model, user exception, unshipped project
code) reaches the client as a message naming its cause. No hub, no network beyond loopback.
"""

import contextlib
import io
import json
import re
import secrets
import time
from pathlib import Path

import pytest
import torch
from conftest import single_threaded

import dla_recipes  # noqa: F401  (compat shim before nnterp)
from dla_recipes.testing.loopback import LoopbackServer, free_port, standardized_model

VOCAB = 64  # words w0..w63, then [UNK], [PAD]
PROMPT = "w1 w5 w9 w2 w7"
LONG_PROMPT = " ".join(f"w{i % VOCAB}" for i in range(7, 7 + 96))
INLINE_LIMIT = 4096  # results above this are downloaded (GET /result), below it ride on the websocket

pytestmark = pytest.mark.server


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab.update({"[UNK]": VOCAB, "[PAD]": VOCAB + 1})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", bos_token="[UNK]", eos_token="[PAD]"
    )


def _save_tiny(folder, model):
    model.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("loopback_models")
    vocab = VOCAB + 2
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    pad_token_id=VOCAB + 1, bos_token_id=VOCAB, eos_token_id=VOCAB + 1)
    )
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                   bos_token_id=VOCAB, eos_token_id=VOCAB + 1)
    )
    return {"tiny-llama": _save_tiny(root / "llama", llama), "tiny-gpt2": _save_tiny(root / "gpt2", gpt2)}


@pytest.fixture(scope="module")
def server(model_folders):
    import psutil

    with LoopbackServer(model_folders, api_key=secrets.token_hex(16), inline_limit=INLINE_LIMIT,
                        forked=True) as running:
        yield running
    assert not running.is_running() and not psutil.pid_exists(running.pid), "the server outlived its fixture"


@pytest.fixture(scope="module")
def remote_models(server):
    return {name: server.remote_model(name) for name in server.models}


@pytest.fixture(scope="module")
def local_models(server):
    return {name: server.local_model(name) for name in server.models}


def _last_record(server, **expected):
    record = server.stats()[-1]
    for key, value in expected.items():
        assert record[key] == value, (key, record)
    return record


@contextlib.contextmanager
def _stdout():
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield buffer


# -- the server ---------------------------------------------------------------------------------------------------


def test_server_listens_on_loopback_only(server):
    import psutil

    listening = [c for c in psutil.Process(server.pid).net_connections() if c.status == psutil.CONN_LISTEN]
    assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}
    assert {c.laddr.port for c in listening} == {server.port}


def test_refuses_a_folder_without_a_model(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LoopbackServer({"nothing": str(tmp_path)}, api_key="k")


# -- remote == local ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_remote_equals_local(server, remote_models, local_models, name):
    remote, local = remote_models[name], local_models[name]
    assert remote.to_model_key().endswith(f'{{"repo_id": "{name}", "revision": null, "task": "text-generation"}}')
    with server.client(), remote.trace(PROMPT, remote=True):
        layer = remote.layers_output[1].save()
        logits = remote.logits.save()
    with single_threaded(), local.trace(PROMPT):
        local_layer = local.layers_output[1].save()
        local_logits = local.logits.save()

    assert logits.shape == (1, 5, VOCAB + 2) and layer.shape == (1, 5, 32)
    assert torch.equal(logits, local_logits)
    assert torch.equal(layer, local_layer)
    # The remote model never loaded weights on the client.
    assert {p.device.type for p in remote._module.parameters()} == {"meta"}
    record = _last_record(server, status="COMPLETED", model=name)
    assert record["request_bytes"] > 0 and record["result_bytes"] > 0
    assert 0 < record["exec_seconds"] <= record["seconds"]


def test_non_blocking_request(server, remote_models, local_models):
    remote, local = remote_models["tiny-llama"], local_models["tiny-llama"]
    with server.client():
        with remote.trace(PROMPT, remote=True, blocking=False) as tracer:
            logits = remote.logits.save()  # noqa: F841  (comes back from the poll)
        backend, result = tracer.backend, None
        for _ in range(300):
            result = backend()  # GET /response/{id}; the saves once COMPLETED
            if result is not None:
                break
            time.sleep(0.05)
    assert result is not None, "the non-blocking request never completed"
    with single_threaded(), local.trace(PROMPT):
        local_logits = local.logits.save()
    assert torch.equal(result["logits"], local_logits)


# -- bytes ----------------------------------------------------------------------------------------------------------


def test_recorded_bytes_are_what_the_client_sent_and_received(server, remote_models):
    remote = remote_models["tiny-gpt2"]
    with server.client(), _stdout() as out, remote.trace(PROMPT, remote=True, verbose=True):
        logits = remote.logits.save()  # noqa: F841
    printed = out.getvalue()
    sent = int(re.search(r"\[remote\] payload: ([\d,]+) bytes", printed).group(1).replace(",", ""))
    received = int(re.search(r"\[remote\] result: ([\d,]+) bytes", printed).group(1).replace(",", ""))
    record = _last_record(server, status="COMPLETED", model="tiny-gpt2")
    assert (record["request_bytes"], record["result_bytes"]) == (sent, received)


def test_small_save_moves_far_fewer_bytes_than_a_layer_output(server, remote_models):
    remote = remote_models["tiny-llama"]
    with server.client():
        with remote.trace(LONG_PROMPT, remote=True):
            one_logit = remote.logits[0, -1, 3].clone().save()
        small = _last_record(server, status="COMPLETED")
        with remote.trace(LONG_PROMPT, remote=True):
            layer = remote.layers_output[1].save()
        whole = _last_record(server, status="COMPLETED")

    assert one_logit.shape == () and layer.shape == (1, 96, 32)
    assert small["transport"] == "inline" and whole["transport"] == "download"
    assert whole["wire_bytes"] == whole["result_bytes"]  # the downloaded body is the result blob itself
    assert small["result_bytes"] * 10 < whole["result_bytes"], (small["result_bytes"], whole["result_bytes"])
    # The request (the traced block + model envelope) costs about the same either way.
    assert abs(small["request_bytes"] - whole["request_bytes"]) < 1024


# -- errors -----------------------------------------------------------------------------------------------------------


def _trace_layer(model, remote=True):
    with model.trace(PROMPT, remote=remote):
        out = model.layers_output[0].save()
    return out


def test_wrong_api_key(server, remote_models):
    from nnsight.intervention.backends.remote import RemoteError

    with server.client(api_key="not-the-key"), pytest.raises(RemoteError, match="Invalid API key"):
        _trace_layer(remote_models["tiny-llama"])
    _last_record(server, status="REJECTED", http_status=403)


def test_missing_api_key(server, remote_models):
    from nnsight.intervention.backends.remote import RemoteError

    with server.client(api_key=None), pytest.raises(RemoteError, match="Missing API key"):
        _trace_layer(remote_models["tiny-llama"])
    _last_record(server, status="REJECTED", http_status=401)


def test_server_unreachable(server, remote_models):
    closed = f"http://127.0.0.1:{free_port()}"
    with server.client(), pytest.raises(ConnectionRefusedError, match="Connection refused"):
        _trace_layer(remote_models["tiny-llama"], remote=closed)


def test_model_not_hosted(server, model_folders):
    from nnsight.intervention.backends.remote import RemoteError

    stranger = standardized_model(model_folders["tiny-gpt2"], remote=True, name="not-served")
    with server.client(), pytest.raises(RemoteError, match="'not-served' is not hosted") as error:
        _trace_layer(stranger)
    assert "tiny-llama" in str(error.value)  # says what it does serve
    _last_record(server, status="REJECTED", http_status=404)


def test_exception_in_trace_body(server, remote_models):
    from nnsight.intervention.backends.remote import RemoteError

    remote = remote_models["tiny-llama"]
    with (
        server.client(),
        pytest.raises(RemoteError, match=r"IndexError: index 99 is out of bounds"),
        remote.trace(PROMPT, remote=True),
    ):
        bad = remote.layers_output[0][0, 99].save()  # noqa: F841  (5 tokens)
    record = _last_record(server, status="ERROR", model="tiny-llama")
    assert record["error"].startswith("IndexError")
    # The server survives a failed request.
    with server.client():
        assert _trace_layer(remote).shape == (1, 5, 32)


def test_unshipped_project_code_fails_as_on_ndif(server, remote_models):
    """The server hides dla_recipes (NDIF doesn't have it): code from it must be nnsight.register()-ed to run."""
    from cloudpickle.cloudpickle import _PICKLE_BY_VALUE_MODULES
    from nnsight.intervention.backends.remote import RemoteError
    from nnsight.ndif import pull_env

    from dla_recipes import _compat

    pull_env()  # what the first remote trace does: registers non-installed ("local") packages for by-value shipping
    # dla_recipes.attribute(remote=...) registers the package in this process (other tests ran it): take that back
    # for this test, as on a fresh client that never registered it, and restore it after.
    registered = {name for name in _PICKLE_BY_VALUE_MODULES if name == "dla_recipes" or name.startswith("dla_recipes.")}
    _PICKLE_BY_VALUE_MODULES.difference_update(registered)
    try:
        remote = remote_models["tiny-llama"]
        with (
            server.client(),
            pytest.raises(RemoteError, match=r"No module named 'dla_recipes.*nnsight\.register"),
            remote.trace(PROMPT, remote=True),
        ):
            flag = _compat._needs_globals_alias()  # noqa: F841
            logits = remote.logits.save()  # noqa: F841
    finally:
        _PICKLE_BY_VALUE_MODULES.update(registered)


# -- hardening: a key on every endpoint, no paths, a size limit, server-chosen ids ----------------------------------


@pytest.mark.parametrize("path", ["/status", "/env", "/connected", "/whoami", "/stats", "/response/x", "/result/x"])
def test_every_endpoint_but_ping_needs_the_key(server, path):
    import httpx

    assert httpx.get(f"{server.url}{path}", timeout=10.0).status_code == 401
    assert httpx.get(f"{server.url}{path}", headers={"ndif-api-key": "wrong"}, timeout=10.0).status_code == 403
    assert httpx.get(f"{server.url}/ping", timeout=10.0).text == '"pong"'


def test_status_names_models_never_folders(server, model_folders):
    import httpx

    body = httpx.get(f"{server.url}/status", headers={"ndif-api-key": server.api_key}, timeout=10.0).text
    assert "tiny-llama" in body
    for folder in model_folders.values():
        assert folder not in body and str(Path(folder).parent) not in body


def test_a_request_over_the_size_limit_is_refused_unread(server):
    import httpx

    limit = 32 * 1024 * 1024
    body = b"x" * (limit + 1)
    response = httpx.post(f"{server.url}/request", content=body, timeout=60.0,
                          headers={"ndif-api-key": server.api_key, "content-type": "multipart/form-data; boundary=b"})
    assert response.status_code == 413 and "too large" in response.json()["detail"]
    _last_record(server, status="REJECTED", http_status=413)


def test_the_server_chooses_the_request_id_and_never_trusts_the_client(server, remote_models):
    """A client-chosen id and ``trusted`` are ignored: the id is the server's, the result is the client's own."""
    import httpx
    from nnsight.schema.request import RequestModel

    remote = remote_models["tiny-llama"]
    envelope = json.loads(RequestModel(model_key=remote.to_model_key()).metadata())
    envelope.update(id="chosen-by-client", trusted=True)
    response = httpx.post(f"{server.url}/request", data={"data": json.dumps(envelope)},
                          files={"blob": ("request", b"not a trace", "application/octet-stream")},
                          headers={"ndif-api-key": server.api_key}, timeout=30.0)
    assert response.status_code == 200
    minted = response.json()["id"]
    assert minted != "chosen-by-client" and re.fullmatch(r"[0-9a-f]{32}", minted)


def test_results_download_only_with_the_presigned_token(server, remote_models):
    """A result too large for the websocket is downloaded from a presigned URL; the bare id is not enough."""
    import httpx

    from dla_recipes.testing.loopback import result_token

    assert result_token(server.api_key, "a") != result_token(server.api_key, "b")
    remote = remote_models["tiny-llama"]  # (test_model_not_hosted re-keys tiny-gpt2's folder)
    with server.client(), remote.trace(LONG_PROMPT, remote=True):
        logits = remote.logits.save()  # 96 x 66 floats: over the inline limit, so downloaded
    assert logits.shape[-1] == VOCAB + 2
    record = _last_record(server, status="COMPLETED", transport="download")
    guessed = httpx.get(f"{server.url}/result/{record['id']}?token={'0' * 64}", timeout=10.0)
    assert guessed.status_code == 401
