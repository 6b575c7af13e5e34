"""Dictionary features (issue 32): the bytes one remote ``attribute`` call's readout brings back from the NDIF-like
loopback server (``result_bytes``: the zstd-compressed result the client downloads), per dictionary width.

``python benchmarks/features_wire.py [--batch 16] [--tokens 128] [--widths 1024,4096,16384]`` on the tiny llama
(``testing.tiny``), every position (``position="all"``) of ``--batch`` prompts of ``--tokens`` token ids, one SAE on
``L1.mlp`` at ``by="block"``: a TopK SAE (``k=32``: its own ``k`` latents a site kept) and a ReLU one with no bias
(about half the latents fire a site: the default cap, ``min(d_sae, 256)``, binds), and, where ``Dictionary`` has ``keep``
(the sparse wire), the same ReLU SAE with every latent sent (``keep=d_sae``). Run it on a checkout without the
sparse wire for the dense "before". Prints one JSON object: bytes per call and the dense float32 size of the
latent columns (``sites * d_sae * 4``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import tempfile

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--widths", default="1024,4096,16384")
    args = parser.parse_args()
    import dla_recipes
    from dla_recipes.features import Dictionary, Encoder
    from dla_recipes.testing import tiny
    from dla_recipes.testing.loopback import LoopbackServer
    from dla_recipes.transport import versions

    folder = tempfile.mkdtemp() + "/llama"
    tiny.build("llama").save_pretrained(folder)
    tiny.tokenizer().save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    vocab = int(tiny.build("llama").config.vocab_size)
    prompts = [torch.randint(3, vocab, (args.tokens,), generator=g).tolist() for _ in range(args.batch)]
    sparse = "keep" in {f.name for f in dataclasses.fields(Dictionary)}
    out = {"batch": args.batch, "tokens": args.tokens, "sparse_wire": sparse, "widths": {}}
    with LoopbackServer({"llama": folder}, api_key=secrets.token_hex(16), ndif=True,
                        min_nnsight_version=versions.client_nnsight()) as server:
        model = server.remote_model("llama")
        d = int(model.config.hidden_size)
        for width in map(int, args.widths.split(",")):
            W_enc, W_dec = torch.randn(d, width, generator=g) / d ** 0.5, torch.randn(width, d, generator=g) / d ** 0.5
            kinds = {"topk32": Dictionary(W_dec, torch.zeros(d), Encoder(W_enc, torch.zeros(width), "topk", k=32)),
                     "relu": Dictionary(W_dec, torch.zeros(d), Encoder(W_enc, torch.zeros(width)))}
            if sparse:
                kinds["relu_every"] = dataclasses.replace(kinds["relu"], keep=width)
            row = {}
            with server.client():
                for name, sae in kinds.items():
                    server.clear_stats()
                    attr = dla_recipes.attribute(model, prompts, "next", position="all", remote=True,
                                                 dictionaries={"L1.mlp": sae})
                    sites = int(attr.mask.sum()) if hasattr(attr, "mask") else None
                    row[name] = server.stats()[-1]["result_bytes"]
                    if name == "relu":
                        F = [j for j, x in enumerate(attr.labels) if x.startswith("L1.mlp.F")]
                        row["relu_active_mean"] = float((attr.values[..., F] != 0).sum(-1).float()[attr.mask].mean())
            row["dense_latent_bytes"] = args.batch * args.tokens * width * 4
            row["sites"] = sites
            out["widths"][width] = row
            print(json.dumps({width: row}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
