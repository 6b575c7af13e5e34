"""GPU benchmark: dla_recipes on a randomly initialised model with Llama-3.1-8B's shapes, in bfloat16.

    python benchmarks/gpu_llama8b.py                 # on a CUDA machine: batch 64 x 128 tokens, ~2-4 min
    python benchmarks/gpu_llama8b.py --tiny          # the same logic on CPU with a tiny shape (a smoke test)

No weights are needed to measure cost: the model is built from a ``LlamaConfig`` with Llama-3.1-8B's shapes (32
layers, d_model 4096, 32 heads / 8 KV heads, d_mlp 14336, vocab 128256) on the meta device, materialised with
``to_empty`` on the GPU and initialised in place (normal(0, 0.02) weights, norm gains 1 + 0.1 * normal, so no gain
is trivially 1). Prompts are ``w<i>`` words of a word-level tokenizer (one token each), so every prompt has exactly
``--seq`` tokens.

Methods, timed interleaved in this one process (median of ``--repeats`` runs after ``--warmup``), ratios to (2):

1. ``plain_forward``: the transformers model under ``torch.no_grad`` (and ``plain_forward_keep1``: with
   ``logits_to_keep=1``);
2. ``trace_logits``: ``with torch.no_grad(), model.trace(batch): model.logits.save()`` (and ``trace_logits_keep1``);
3. ``dla_block`` / ``dla_head`` / ``dla_neuron``: ``dla_recipes.attribute(model, prompts, target, by=...)`` (the
   public API; it runs the head on the attributed positions only, ``logits_to_keep``); ``dla_head_all``: by head at
   every position (``position="all"``: its fair floor is (2) itself, every position's logits); ``dla_features``: by
   block with a TopK SAE (16384 latents, k=32, random weights) on the middle block's MLP (issue 32);
   ``recipe_*``: the in-trace recipe in a plain trace (every position through ``lm_head``), to show what that lever
   saves.

For each: peak GPU memory above the loaded model (``torch.cuda.max_memory_allocated`` after a reset), and for (3)
the attribution's error against the model's own logit, in bfloat16 (the recipe accumulates in float32; the
self-check's bfloat16 tolerance is 5e-2 relative). Writes ``gpu_llama8b.json`` to ``$OUT`` when set, else to
``benchmarks/results/``.

Optional (issue 23, ``gpu_profile.py``): ``--profile`` runs one ``attribute`` call per granularity under
``torch.profiler`` (CPU + CUDA activities) and records the top 15 ops by self CUDA time and by self CPU time;
``--sync-check`` runs one call per granularity under ``torch.cuda.set_sync_debug_mode("warn")`` and records how many
syncs it warned about and where. Both go to ``gpu_llama8b_profile.json`` (``_tiny`` with ``--tiny``) beside the main
JSON, whose format is unchanged; ``--no-timing`` skips the timed methods (and the main JSON) to save device time.
Without CUDA the profile records CPU ops only and the sync check says it was skipped.

Needs torch with CUDA, transformers, nnsight, nnterp; the repository root is put on ``sys.path`` so
``import dla_recipes`` works from a checkout without installing it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # gpu_profile.py

LLAMA_31_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
TINY = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False}


def build_model(shape: dict, device, dtype, seed: int = 0):
    """A random Llama with ``shape``: meta device, ``to_empty`` on ``device``, initialised in place."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**shape, pad_token_id=shape["vocab_size"] - 1, bos_token_id=0, eos_token_id=1)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:  # RMSNorm gains
                parameter.copy_(1.0 + 0.1 * torch.randn(parameter.shape, generator=generator, device=device))
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    rotary = LlamaRotaryEmbedding(config=config)  # its inv_freq buffers are not parameters: rebuild them
    model.model.rotary_emb = rotary.to(device)
    return model.eval(), config


def word_tokenizer(vocab: int):
    """Word-level tokenizer: ``w0`` .. ``w{vocab-3}``, [UNK], [PAD] (dla_recipes.testing.tiny's), left padding."""
    from dla_recipes.testing import tiny

    return tiny.tokenizer(vocab)


def profile_and_check(args, calls: dict, cuda: bool, sync, meta: dict) -> dict:
    """``--profile`` / ``--sync-check``: run them (``gpu_profile.py``), write and print their record."""
    import gpu_profile

    record = {**meta, "tiny": args.tiny, "failures": {}}
    for flag, key, run in ((args.profile, "profile", lambda: gpu_profile.profile(calls, cuda, sync)),
                           (args.sync_check, "sync_check", lambda: gpu_profile.sync_check(calls, cuda))):
        if not flag:
            continue
        try:
            record[key] = run()
        except Exception as error:  # noqa: BLE001 - recorded, the timed methods still run
            record["failures"][key] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"
    for key in ("profile", "sync_check"):
        skipped = (record.get(key) or {}).get("skipped")
        if skipped:
            print(f"{key}: skipped {skipped}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("gpu_llama8b_profile_tiny.json" if args.tiny else "gpu_llama8b_profile.json")
    path.write_text(json.dumps(record, indent=1))
    for line in gpu_profile.summary(record):
        print(line)
    for key, text in record["failures"].items():
        print(f"FAILED {key}: {text.splitlines()[0]}")
    print(f"wrote {path}")
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shape on CPU: check the logic without a GPU")
    parser.add_argument("--batch", type=int, default=None, help="prompts (default 64; --tiny 4)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per prompt (default 128; --tiny 16)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default=None, help="default: cuda if available (cpu with --tiny)")
    parser.add_argument("--methods", default=None, help="comma list (default: all)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--profile", action="store_true", help="torch.profiler: one call per granularity")
    parser.add_argument("--sync-check", action="store_true", help="set_sync_debug_mode('warn'): one call per by")
    parser.add_argument("--no-timing", action="store_true", help="only --profile / --sync-check (no main JSON)")
    args = parser.parse_args(argv)
    t_start = time.perf_counter()

    import torch

    import dla_recipes  # its nnterp shim must load before nnterp
    from dla_recipes.transport.batches import prepare

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    cuda = device.type == "cuda"
    batch = args.batch or (4 if args.tiny else 64)
    seq = args.seq or (16 if args.tiny else 128)
    shape = TINY if args.tiny else LLAMA_31_8B
    dtype = torch.bfloat16

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def allocated():
        return torch.cuda.memory_allocated(device) if cuda else 0

    t0 = time.perf_counter()
    hf, config = build_model(shape, device, dtype)
    sync()
    build_s = time.perf_counter() - t0
    tok = word_tokenizer(config.vocab_size)
    model = dla_recipes.load(hf, tokenizer=tok)
    words = config.vocab_size - 2
    prompts = [" ".join(f"w{(97 * i + 31 * j + 7) % words}" for j in range(seq)) for i in range(batch)]
    target = "w42"
    encoding = tok(prompts, return_tensors="pt", padding=True)
    encoding = {k: v.to(device) for k, v in encoding.items() if k in ("input_ids", "attention_mask")}
    assert encoding["input_ids"].shape == (batch, seq), encoding["input_ids"].shape
    plan = dla_recipes.plan.build_plan(model)
    prepared = prepare(model, prompts, target)
    loaded = allocated()

    def plain(keep):
        kw = {"logits_to_keep": 1} if keep else {}

        def run():
            with torch.no_grad():
                hf(**encoding, **kw)
        return run

    def trace(keep):
        kw = {"logits_to_keep": 1} if keep else {}

        def run():
            with torch.no_grad():  # noqa: SIM117 - nnsight finds a trace by its own `with` line
                with model.trace(dict(encoding), **kw):
                    model.logits.save()
        return run

    def dla(by, **options):
        def run():
            return dla_recipes.attribute(model, prompts, target, by=by, **options).error
        return run

    def dictionary(width: int, layer: int):
        """A TopK SAE (k=32) with random weights on block ``layer``'s MLP output (issue 32's features)."""
        from dla_recipes.features import Dictionary, Encoder

        d, generator = config.hidden_size, torch.Generator(device="cpu").manual_seed(0)

        def weights(*size):
            return (torch.randn(*size, generator=generator) / d**0.5).to(device)

        encoder = Encoder(weights(d, width), torch.zeros(width, device=device), activation="topk", k=32)
        return {f"L{layer}.mlp": Dictionary(weights(width, d), torch.zeros(d, device=device), encoder)}

    def recipe(by):
        import nnsight

        from dla_recipes.trace import direct_logit_attribution

        def run():
            positions, targets = prepared.positions, prepared.targets
            with torch.no_grad():  # noqa: SIM117 - nnsight finds a trace by its own `with` line
                with model.trace(dict(encoding)):
                    packed = nnsight.save(direct_logit_attribution(model, plan, positions, targets, None, by).pack())
            readout = dla_recipes.trace.Readout.unpack(packed)
            return float((readout.values.sum(-1) + readout.constant - readout.logit).abs().max())
        return run

    if args.profile or args.sync_check:
        profiled = profile_and_check(args, {f"dla_{by}": dla(by) for by in ("block", "head", "neuron")}, cuda, sync,
                                     {"shape": {k: v for k, v in shape.items() if k != "rope_scaling"}, "batch": batch,
                                      "seq": seq, "device": str(device), "torch": torch.__version__})
        if args.no_timing:
            return 1 if profiled.get("failures") else 0

    table = {"plain_forward": plain(False), "plain_forward_keep1": plain(True), "trace_logits": trace(False),
             "trace_logits_keep1": trace(True), "dla_block": dla("block"), "dla_head": dla("head"),
             "dla_neuron": dla("neuron"), "dla_head_all": dla("head", position="all"),
             "dla_features": dla("block", dictionaries=dictionary(16384 if not args.tiny else 256,
                                                                  config.num_hidden_layers // 2)),
             "recipe_block": recipe("block"), "recipe_head": recipe("head"), "recipe_neuron": recipe("neuron")}
    if args.methods:
        table = {k: v for k, v in table.items() if k in args.methods.split(",") or k == "trace_logits"}

    methods, errors, failures, memory = {}, {}, {}, {}
    for name, fn in table.items():
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            before = allocated()
            value = fn()  # first call: a warm-up that also gives the error and the peak memory
            sync()
            if cuda:
                memory[name] = {"peak_above_loaded_mb": (torch.cuda.max_memory_allocated(device) - before) / 2**20}
            errors[name] = None if value is None else float(value)
            methods[name] = fn
        except Exception as error:  # noqa: BLE001 - recorded (an ExactnessError reports the bfloat16 error)
            failures[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"
    for fn in methods.values():
        for _ in range(max(0, args.warmup - 1)):
            fn()
    samples = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - t)
    results = {}
    base = samples.get("trace_logits")
    for name, values in samples.items():
        entry = {"median_s": statistics.median(values), "min_s": min(values), "samples_s": values,
                 "max_error": errors.get(name), **memory.get(name, {})}
        if base:
            entry["ratio_to_trace_logits"] = statistics.median(v / b for v, b in zip(values, base))
        results[name] = entry
    out = {
        "shape": {k: v for k, v in shape.items() if k != "rope_scaling"}, "tiny": args.tiny, "dtype": str(dtype),
        "batch": batch, "seq": seq, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__, "loaded_model_mb": loaded / 2**20, "build_s": build_s,
        "repeats": args.repeats, "warmup": args.warmup, "results": results, "failures": failures,
        "total_s": time.perf_counter() - t_start,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("gpu_llama8b_tiny.json" if args.tiny else "gpu_llama8b.json")
    path.write_text(json.dumps(out, indent=1))
    print(f"{'method':24s} {'median ms':>10s} {'ratio to (2)':>13s} {'peak MB':>9s} {'error':>9s}")
    for name, r in results.items():
        ratio = r.get("ratio_to_trace_logits")
        peak = r.get("peak_above_loaded_mb")
        err = r.get("max_error")
        print(f"{name:24s} {r['median_s'] * 1e3:10.1f} {ratio if ratio is None else f'{ratio:.3f}':>13} "
              f"{'-' if peak is None else f'{peak:.0f}':>9s} {'-' if err is None else f'{err:.2e}':>9s}")
    for name, text in failures.items():
        print(f"FAILED {name}: {text.splitlines()[0]}")
    print(f"wrote {path} ({out['total_s']:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
