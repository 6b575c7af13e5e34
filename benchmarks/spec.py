"""The benchmark's models and prompts, written once to a spec file that every worker reads (both venvs).

Models (folders of safetensors + tokenizer, so plain transformers, nnsight/nnterp, the loopback NDIF server and
TransformerLens all load the very same weights):

- ``smollm2``: SmolLM2-135M-Instruct in float32, the project's default model (``dla_recipes.models``).
- ``wide``: a random Llama (``WIDE``: d_model 512, d_mlp 2048, 8 layers, 8 heads / 4 KV heads, vocab 128), perturbed
  like the test suite's tiny models so no gain or bias is trivially 1 or 0, saved under ``<out>/models``.

Prompts: each model gets ``max(batch sizes)`` distinct prompts of exactly ``PROMPT_TOKENS`` tokens (no padding, so
every method, TransformerLens included, attributes the same last position); a batch of ``n`` is the first ``n``.
"""

from __future__ import annotations

import json
from pathlib import Path

PROMPT_TOKENS = 12
WIDE = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 4}
TINY_VOCAB = 128

SENTENCES = [
    "The Eiffel Tower is a famous landmark that stands in the beautiful French capital city of",
    "After a long flight from New York, we finally landed at the airport in the city of",
    "The Louvre museum, home of the Mona Lisa, is located in the center of",
    "She studied art history for four years at a well known university in",
    "The river Seine flows slowly through the heart of the old city of",
    "Every summer my grandparents take the night train from Berlin all the way to",
    "The capital of France, known for its cafes and boulevards, is the city of",
    "Notre Dame cathedral was badly damaged by a fire in the spring of 2019 in",
    "Our hotel had a wonderful view of the Arc de Triomphe and the streets of",
    "The fashion week that everyone talks about takes place every year in the city of",
    "He bought a small apartment near the Champs Elysees when he moved to",
    "The first modern Olympic Games after the war were held in London, and in 2024 in",
    "Tourists from all over the world queue for hours to climb the tower in",
    "The famous painter spent the last years of his life in a small studio in",
    "The peace conference that ended the First World War was held near the city of",
    "My favourite bakery sells the best croissants I have ever eaten, right here in",
]


def wide_config(**over):
    from transformers import LlamaConfig

    kw = dict(vocab_size=TINY_VOCAB, pad_token_id=TINY_VOCAB - 1, bos_token_id=0, eos_token_id=1,
              tie_word_embeddings=False, max_position_embeddings=4096, **WIDE)
    kw.update(over)
    return LlamaConfig(**kw)


def build_tiny_folder(folder: Path, config, seed: int = 0) -> Path:
    """Build a random perturbed Llama from ``config`` and save it with the tiny word-level tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    import dla_recipes  # noqa: F401 - its nnterp shim must load before nnterp
    from dla_recipes.testing import tiny

    folder = Path(folder)
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    tiny.perturb(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tiny.tokenizer(config.vocab_size).save_pretrained(folder)
    return folder


def tiny_prompts(n: int, length: int, offset: int = 0) -> list[str]:
    return [" ".join(f"w{(7 * i + 3 * j + offset) % 100 + 2}" for j in range(length)) for i in range(n)]


def smollm2_prompts(tokenizer, n: int, length: int = PROMPT_TOKENS) -> list[str]:
    """``n`` prompts of exactly ``length`` tokens: sentences cut to their last ``length`` tokens (they end before
    the city, so `` Paris`` is a natural target), kept only if they re-tokenize to the same ids."""
    out = []
    for sentence in SENTENCES:
        ids = tokenizer(sentence, add_special_tokens=False)["input_ids"][-length:]
        text = tokenizer.decode(ids)
        if tokenizer(text, add_special_tokens=False)["input_ids"] == ids and text not in out:
            out.append(text)
    if len(out) < n:  # repeat (a batch of identical prompts costs the same)
        out = (out * (n // max(1, len(out)) + 1))[:n]
    return out[:n]


def write_spec(out: Path, models: list[str], batches: list[int], quick: bool) -> Path:
    """Prepare the model folders and prompts; return the spec file's path."""
    from transformers import AutoConfig, AutoTokenizer

    out = Path(out)
    spec: dict = {"prompt_tokens": PROMPT_TOKENS, "batches": batches, "models": {}}
    n = max(batches)
    for key in models:
        if key == "smollm2":
            from dla_recipes import models as dla_models

            folder = Path(dla_models.default_model_path())
            tokenizer = AutoTokenizer.from_pretrained(folder)
            prompts = smollm2_prompts(tokenizer, n)
            target = " Paris"
            description = "SmolLM2-135M-Instruct, float32 (30 layers, d_model 576, 9 heads, d_mlp 1536, vocab 49152)"
        elif key == "wide":
            folder = build_tiny_folder(out / "models" / "wide-llama", wide_config())
            tokenizer = AutoTokenizer.from_pretrained(folder)
            prompts = tiny_prompts(n, PROMPT_TOKENS)
            target = "w20"
            description = ("random wide tiny Llama, float32 (8 layers, d_model 512, 8 heads / 4 KV, d_mlp 2048, "
                           "vocab 128)")
        else:
            raise ValueError(f"unknown model {key!r}")
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        lengths = sorted({len(i) for i in ids})
        config = AutoConfig.from_pretrained(folder)
        target_id = tokenizer(target, add_special_tokens=False)["input_ids"]
        assert len(target_id) == 1, (target, target_id)
        spec["models"][key] = {
            "folder": str(folder),
            "description": description,
            "prompts": prompts,
            "input_ids": ids,
            "prompt_lengths": lengths,
            "target": target,
            "target_id": target_id[0],
            "n_layers": config.num_hidden_layers,
            "d_model": config.hidden_size,
            "n_heads": config.num_attention_heads,
            "d_mlp": config.intermediate_size,
            "vocab": config.vocab_size,
        }
    path = out / "spec.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=1))
    return path
