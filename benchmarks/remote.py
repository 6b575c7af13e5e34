"""Remote measurements on the loopback NDIF server: ``python benchmarks/remote.py --spec SPEC [--quick]``.

The server (``dla_recipes.testing.loopback``) runs nnsight's real remote protocol and the ``ndif`` package's
own execution code in a separate, single-threaded process. For each served model, prompt length and method it
records the server's per-request ``request_bytes`` (the serialized trace the client sends), ``result_bytes`` (the
serialized result the client downloads), ``seconds`` (round trip, server clock: from the client's send stamp to
the result handed over) and the client's wall time for the whole call.

Methods: ``dla_block`` / ``dla_head`` / ``dla_neuron`` (``dla_recipes.attribute(..., remote=True)``) and the
save-everything recipe remotely (``save_all_block``: every layer's attention and MLP output ``[batch, pos,
d_model]``; ``save_all_neuron``: every layer's attention output and ``down_proj`` input ``[batch, pos, d_mlp]``),
whose attribution is computed on the client from what came back (with weights the client loads from the folder:
a remote model has none). The target: a dla_recipes result of at most
``1024 + 8 * n_components`` bytes, whatever the prompt length and the model width.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

LONG_TOKENS = 256


def long_prompt(entry: dict, tokenizer, tokens: int) -> str:
    if entry["target"] == " Paris":  # SmolLM2: natural text, cut to ``tokens`` tokens
        import spec

        text = " ".join(spec.SENTENCES * 8)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][-tokens:]
        return tokenizer.decode(ids)
    import spec

    return spec.tiny_prompts(1, tokens, offset=5)[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--models", default="tiny,wide,smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=LONG_TOKENS)
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded calls per method before the timed ones "
                        "(one warm-up request per model is always made)")
    parser.add_argument("--methods", default="dla_block,dla_head,dla_neuron,save_all_block,save_all_neuron")
    args = parser.parse_args(argv)
    common.offline()
    threads = common.set_threads()
    import local
    import spec as spec_module
    import torch
    from transformers import AutoTokenizer

    import dla_recipes
    from dla_recipes.testing.loopback import LoopbackServer

    spec = common.read_json(args.spec)
    out_root = Path(args.spec).parent
    folders, entries = {}, {}
    for key in args.models.split(","):
        if key == "tiny":  # the test suite's tiny Llama (d_model 64): the narrow end of "independent of width"
            folder = spec_module.build_tiny_folder(out_root / "models" / "tiny-llama", spec_module.wide_config(
                hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2))
            entry = {"folder": str(folder), "target": "w20", "description": "tiny Llama (3 layers, d_model 64, d_mlp 128)"}
        else:
            entry = dict(spec["models"][key])
        folders[key], entries[key] = entry["folder"], entry
    records = []
    failures = {}
    t_start = time.perf_counter()
    with LoopbackServer(folders, api_key=secrets.token_hex(16)) as server:
        startup = time.perf_counter() - t_start
        for key, entry in entries.items():
            tokenizer = AutoTokenizer.from_pretrained(entry["folder"])
            target_id = tokenizer(entry["target"], add_special_tokens=False)["input_ids"][0]
            model = server.remote_model(key)
            plain = common.load_plain(entry["folder"])  # the save-everything recipe's weights, on the client
            config = model.config
            prompts = {
                "short": entry["prompts"][0] if "prompts" in entry else spec_module.tiny_prompts(1, spec_module.PROMPT_TOKENS)[0],
                "long": long_prompt(entry, tokenizer, args.long_tokens),
            }
            with server.client():  # the first request of a session ships the package: not recorded
                dla_recipes.attribute(model, prompts["short"], entry["target"], remote=True)
            for length, prompt in prompts.items():
                ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                encoding = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
                for method in args.methods.split(","):
                    samples, wall = [], []
                    error = n_components = None
                    try:
                        for repeat in range(args.warmup + args.repeats):  # warm-up calls are not recorded
                            server.clear_stats()
                            t0 = time.perf_counter()
                            with server.client():
                                if method.startswith("dla_"):
                                    attr = dla_recipes.attribute(model, prompt, entry["target"], by=method[4:],
                                                                 remote=True)
                                    error, n_components = attr.error, len(attr.labels)
                                else:
                                    values, logit, _ = local.save_everything(model, encoding, target_id,
                                                                             method.rsplit("_", 1)[1], remote=True,
                                                                             weights=plain)
                                    error = float((values.sum(-1) - logit).abs().max())
                                    n_components = values.shape[-1]
                            elapsed = time.perf_counter() - t0
                            stats = [s for s in server.stats() if s.get("status") == "COMPLETED"]
                            if len(stats) != 1:
                                raise RuntimeError(f"expected one completed request, got {server.stats()}")
                            if repeat >= args.warmup:
                                wall.append(elapsed)
                                samples.append(stats[0])
                    except Exception as problem:  # noqa: BLE001 - recorded in the results; the rest still runs
                        failures[f"{key}/{length}/{method}"] = f"{type(problem).__name__}: {problem}\n" \
                                                              f"{traceback.format_exc(limit=6)}"
                        continue
                    last = samples[-1]
                    bound = 1024 + 8 * n_components
                    records.append({
                        "model": key, "d_model": config.hidden_size, "d_mlp": config.intermediate_size,
                        "n_layers": config.num_hidden_layers, "prompt": length, "tokens": len(ids),
                        "method": method, "n_components": n_components,
                        "request_bytes": last["request_bytes"], "result_bytes": last["result_bytes"],
                        "wire_bytes": last.get("wire_bytes"), "transport": last.get("transport"),
                        "round_trip_s": statistics.median(s["seconds"] for s in samples),
                        "exec_s": statistics.median(s["exec_seconds"] for s in samples if s.get("exec_seconds") is not None)
                        if any(s.get("exec_seconds") is not None for s in samples) else None,
                        "client_wall_s": statistics.median(wall),
                        "max_error": error,
                        "result_bound_bytes": bound,
                        "within_bound": last["result_bytes"] <= bound if method.startswith("dla_") else None,
                    })
    common.emit({"records": records, "failures": failures, "server_startup_s": startup, "threads": threads,
                 "server_threads": 1, "descriptions": {k: e.get("description") for k, e in entries.items()}})


if __name__ == "__main__":
    main()
