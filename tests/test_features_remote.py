"""Dictionary features on the NDIF-like loopback server (bfloat16, sdpa, every request under ``torch.autocast``):
the dictionary travels with the request and the remote attribution equals the local one bit for bit (the same
bfloat16 model under the same bracket); the request grows by the dictionary's bytes (measured from the server's
own record of each request); a dictionary over the request limit is refused before anything is sent, naming its
size and the limit; a dictionary given as a function cannot travel and is refused.
"""

from __future__ import annotations

import secrets
from dataclasses import replace

import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, single_threaded

import dla_recipes
from dla_recipes.errors import InputError
from dla_recipes.features import Dictionary, Encoder, bind
from dla_recipes.testing import tiny
from dla_recipes.testing.loopback import LoopbackServer
from dla_recipes.trace.readout import Readout
from dla_recipes.transport import versions

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("served") / "llama")
    tiny.build("llama").save_pretrained(folder)
    tiny.tokenizer().save_pretrained(folder)
    with LoopbackServer({"llama": folder}, api_key=secrets.token_hex(16), ndif=True, forked=True,
                        min_nnsight_version=versions.client_nnsight()) as running:
        yield running


def dictionary(d: int, width: int, skip: bool = False) -> Dictionary:
    g = torch.Generator().manual_seed(width)
    W_enc = torch.randn(d, width, generator=g) / d ** 0.5
    encoder = Encoder(W_enc, torch.full((width,), -0.02), "jumprelu", torch.full((width,), 0.01))
    return Dictionary(torch.randn(width, d, generator=g) / d ** 0.5, 0.01 * torch.randn(d, generator=g), encoder,
                      0.1 * torch.randn(d, d, generator=g) if skip else None, "input" if skip else "output")


def test_remote_equals_local_and_the_request_carries_the_dictionary(server):
    remote_model, local = server.remote_model("llama"), server.local_model("llama", dispatch=True)
    d = int(local.lm_head.weight.shape[-1])
    dictionaries = {"L2.mlp": dictionary(d, 512, skip=True), "L1.resid": dictionary(d, 256)}
    call = {"contrast": CONTRAST, "by": "head", "dictionaries": dictionaries}
    server.clear_stats()
    with server.client():
        plain = dla_recipes.attribute(remote_model, PROMPTS, TARGET, contrast=CONTRAST, by="head", remote=True)
        bare_bytes = server.stats()[-1]["request_bytes"]
        remote = dla_recipes.attribute(remote_model, PROMPTS, TARGET, remote=True, **call)
        sent = server.stats()[-1]["request_bytes"]
    with single_threaded(), server.bracket():
        mine = dla_recipes.attribute(local, PROMPTS, TARGET, **call)
    assert remote.labels == mine.labels and torch.equal(remote.values, mine.values)
    assert torch.equal(remote.logit, mine.logit)
    weights = sum(x.nbytes() for x in dictionaries.values())
    # the request carries every weight once (float32 here, compressed: random floats shrink by ~10%, never by half)
    # plus its pickling: a few KB
    assert weights / 2 <= sent - bare_bytes <= weights + 64 * 1024, (sent, bare_bytes, weights)
    assert plain.labels != remote.labels


def test_a_dictionary_over_the_request_limit_is_refused_with_its_size(server, monkeypatch):
    remote_model = server.remote_model("llama")
    d = int(remote_model.config.hidden_size)
    big = dictionary(d, 4096)
    monkeypatch.setattr(bind, "REQUEST_LIMIT", big.nbytes() - 1)
    with server.client(), pytest.raises(InputError, match=f"{big.nbytes():,} bytes, over the server's request limit"):
        dla_recipes.attribute(remote_model, PROMPTS, TARGET, remote=True, dictionaries={"L1.mlp": big})
    encoded = Dictionary(big.W_dec, big.b_dec, lambda x: x @ big.encoder.W_enc)
    with server.client(), pytest.raises(InputError, match="cannot travel"):
        dla_recipes.attribute(remote_model, PROMPTS, TARGET, remote=True, dictionaries={"L1.mlp": encoded})


def test_only_the_kept_latents_come_back(server):
    """The readout's bytes back (``result_bytes``: the zstd result the client downloads) at a 4096-latent TopK SAE
    on 4 x 64 sites (k=32 kept a site) are at most the sparse wire's own float32 size plus its pickling (64 KB),
    under a tenth of the dense latent columns' float32 size (``4 * sites * 4096``), and the kept latents are the
    numbers every latent sent (``keep=4096``) gives. The dense readout before the wire, measured by
    ``benchmarks/features_wire.py`` on the same server: 3.5 MB at 16 x 128 sites, against 0.51 MB now."""
    remote_model = server.remote_model("llama")
    d, width, k = int(remote_model.config.hidden_size), 4096, 32
    g = torch.Generator().manual_seed(3)
    W_enc, W_dec = torch.randn(d, width, generator=g) / d ** 0.5, torch.randn(width, d, generator=g) / d ** 0.5
    sae = Dictionary(W_dec, torch.zeros(d), Encoder(W_enc, torch.zeros(width), "topk", k=k))
    prompts = [torch.randint(3, int(remote_model.config.vocab_size), (64,), generator=g).tolist() for _ in range(4)]
    got = {}
    with server.client():
        for name, keep in (("sparse", None), ("every", width)):
            server.clear_stats()
            got[name] = dla_recipes.attribute(remote_model, prompts, "next", position="all", remote=True,
                                              dictionaries={"L1.mlp": replace(sae, keep=keep)})
            got[name + "_bytes"] = server.stats()[-1]["result_bytes"]
    mask = got["sparse"].mask  # [prompts, positions]: the attributed sites (the others NaN)
    assert torch.equal(got["sparse"].values[mask], got["every"].values[mask])
    sites, columns = int(mask.sum()), len(got["sparse"].labels) - width + len(Readout.FIELDS)
    wire = 4 * sites * (columns + 2 * k)  # one float32 row a site
    assert got["sparse_bytes"] <= wire + 64 * 1024 < 4 * sites * width / 10, (got, wire, sites)
