"""A small SAE trained here on real English text, for the docs' "Features" page: the data, the training, the cache.

The text is the Lee corpus (300 Australian news articles, ~60k words) that gensim ships in its wheel
(``gensim/test/test_data/lee_background.cor``): fetched once with ``pip download --no-deps gensim`` (nothing is
installed) into the model cache (``loading.fetch.cache_dir()``), sha256-checked. ``collect`` runs the model on its
first ``tokens`` tokens in windows of ``window`` and keeps what block ``layer``'s MLP writes at every position
``[tokens, d_model]`` (a plain transformers forward with a torch hook, stopped after that block); ``train`` fits a
ReLU SAE to them (Adam, an L1 penalty on the latents times their decoder norms, unit-norm decoder rows; 600 steps
of 256 rows: with the collection, about two minutes of 1-2 CPU cores); ``cached_sae`` does both once and keeps the weights, the token
windows and each token's top latents under ``cache_dir()/sae-<model>-L<layer>-<width>`` like the models (never in
git). ``top_contexts`` lists a latent's most activating tokens with their context.

    python -m dla_recipes.testing.dictionaries   # train (or load) the docs' SAE and print its statistics
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..features import Dictionary, Encoder
from ..loading.fetch import cached_artifact, fetch_wheel_files

CORPUS = ("gensim==4.4.0", "gensim/test/test_data/lee_background.cor",
          "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb")


def lee_corpus() -> list[str]:
    """The Lee background corpus, one article a string (fetched once into the cache)."""
    requirement, member, sha = CORPUS

    def build(folder: Path) -> dict:
        fetch_wheel_files(requirement, {member: ("lee_background.cor", sha)}, folder)
        return {"source": f"{requirement}: {member}"}

    folder = cached_artifact("lee-corpus", build)
    return [line.strip() for line in (folder / "lee_background.cor").read_text().splitlines() if line.strip()]


class _Stop(Exception):
    """Raised by the hook after the collected block: the rest of the forward pass is not needed."""


def collect(model, layer: int, tokens: int = 8192, window: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [windows, window], acts [windows * window, d_model])``: what block ``layer``'s MLP writes at every
    position of the corpus's first ``tokens`` tokens (windows of ``window``; a plain transformers forward with a
    torch hook on the MLP, stopped there), float32."""
    ids = model.tokenizer("\n".join(lee_corpus()), return_tensors="pt")["input_ids"][0][: tokens - tokens % window]
    ids = ids.reshape(-1, window)
    mlp, kept = model.layers[layer]._module.mlp, []

    def hook(module, args, output):
        kept.append(output.detach().float().flatten(0, 1))
        raise _Stop

    handle = mlp.register_forward_hook(hook)
    try:
        with torch.no_grad():
            for start in range(0, ids.shape[0], 8):
                try:
                    model._module(input_ids=ids[start:start + 8])
                except _Stop:
                    pass
    finally:
        handle.remove()
    return ids, torch.cat(kept)


def train(acts: torch.Tensor, width: int, steps: int = 600, l1: float = 0.1, batch: int = 256,
          seed: int = 0) -> Dictionary:
    """A ReLU SAE ``[d_model -> width]`` fitted to ``acts`` ``[n, d_model]`` (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    d = acts.shape[1]
    scale = float(acts.norm(dim=-1).mean())
    W_dec = torch.nn.Parameter(torch.randn(width, d, generator=g) / d ** 0.5)
    W_enc = torch.nn.Parameter(W_dec.detach().t().clone())
    b_enc = torch.nn.Parameter(torch.zeros(width))
    b_dec = torch.nn.Parameter(acts.mean(0).clone())
    optimiser = torch.optim.Adam([W_dec, W_enc, b_enc, b_dec], lr=2e-3)
    for _ in range(steps):
        x = acts[torch.randint(0, acts.shape[0], (batch,), generator=g)] / scale
        with torch.no_grad():
            W_dec.div_(W_dec.norm(dim=-1, keepdim=True))
        a = torch.relu((x - b_dec / scale) @ W_enc + b_enc)
        loss = ((a @ W_dec + b_dec / scale - x) ** 2).sum(-1).mean() + l1 * a.sum(-1).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    with torch.no_grad():  # back to the activations' own scale: encode(x) = relu((x - b_dec) @ W_enc / scale + b)
        W_dec.div_(W_dec.norm(dim=-1, keepdim=True))
        encoder = Encoder((W_enc / scale).detach().clone(), b_enc.detach().clone(), "relu",
                          b_in=b_dec.detach().clone())
        return Dictionary((W_dec * scale).detach().clone(), b_dec.detach().clone(), encoder)


@dataclass(frozen=True)
class Trained:
    """The docs' SAE, its training windows ``ids`` ``[windows, window]`` and each token's latents' top ``k``
    (``top_values`` / ``top_latents`` ``[tokens, k]``), with its fraction of variance explained and mean L0."""

    dictionary: Dictionary
    ids: torch.Tensor
    top_values: torch.Tensor
    top_latents: torch.Tensor
    explained: float
    l0: float


def cached_sae(model, name: str, layer: int, width: int = 1024, tokens: int = 8192) -> Trained:
    """Train (once, then load from the cache) an SAE on block ``layer``'s MLP output of ``model`` (``name`` keys
    the cache: the model's short name)."""

    def build(folder: Path) -> dict:
        ids, acts = collect(model, layer, tokens)
        d = train(acts, width)
        latents = torch.cat([d.encoder(chunk) for chunk in acts.split(4096)])
        recon = latents @ d.W_dec + d.b_dec
        explained = 1 - float(((acts - recon) ** 2).sum() / ((acts - acts.mean(0)) ** 2).sum())
        top = latents.topk(8, dim=-1)
        torch.save({"W_dec": d.W_dec, "b_dec": d.b_dec, "W_enc": d.encoder.W_enc, "b_enc": d.encoder.b_enc,
                    "b_in": d.encoder.b_in, "ids": ids, "top_values": top.values.half(), "top_latents":
                    top.indices.short()}, folder / "sae.pt")
        stats = {"explained": explained, "l0": float((latents > 0).sum(-1).float().mean())}
        (folder / "stats.json").write_text(json.dumps(stats))
        return {"layer": layer, "width": width, "tokens": int(ids.numel()), **stats}

    folder = cached_artifact(f"sae-{name}-L{layer}-{width}", build)
    w = torch.load(folder / "sae.pt")
    stats = json.loads((folder / "stats.json").read_text())
    d = Dictionary(w["W_dec"], w["b_dec"], Encoder(w["W_enc"], w["b_enc"], "relu", b_in=w["b_in"]))
    return Trained(d, w["ids"], w["top_values"].float(), w["top_latents"].long(), stats["explained"], stats["l0"])


def top_contexts(trained: Trained, tokenizer, latent: int, k: int = 3, before: int = 8) -> list[tuple[float, str]]:
    """The ``k`` training tokens on which ``latent`` fires most (among each token's top latents), as ``(activation,
    context)`` with the token in ``[[...]]`` after ``before`` tokens of context."""
    hits = (trained.top_latents == latent)
    values = torch.where(hits, trained.top_values, torch.zeros_like(trained.top_values)).amax(-1)
    order = values.argsort(descending=True)[:k]
    flat, window = trained.ids.flatten(), trained.ids.shape[1]
    out = []
    for t in order.tolist():
        if values[t] <= 0:
            break
        start = max(t - before, t - t % window)
        context = tokenizer.decode(flat[start:t]) + "[[" + tokenizer.decode(flat[t:t + 1]) + "]]"
        out.append((float(values[t]), context.replace("\n", " ")))
    return out


if __name__ == "__main__":
    import dla_recipes
    from dla_recipes import models

    model = dla_recipes.load(models.default_model_path(), dispatch=True)
    trained = cached_sae(model, "smollm2-instruct", 24)
    print({"explained": trained.explained, "l0": trained.l0, "width": trained.dictionary.width})
