"""Which decoder-only text model types fail inside nnterp's load, and with what error (issue 12, item 6).

For every model type in transformers' causal-LM mapping whose config is a plain text config (no sub-configs, not
an encoder-decoder, no ``encoder`` module), build a tiny random model from its default config shrunk to 2 layers / width 64 / vocabulary
128 (per-layer lists cut to 2), load it with ``dla_recipes.load``, and print one line per type:
``ok``, ``skip (<why the tiny model could not be built or run>)`` or ``FAIL <error type>: <first line>``.

Bounded: types whose tiny model still has more than 20M parameters are skipped, each load has 60 s.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python notes/nnterp_load_survey.py [model_type ...]
"""

from __future__ import annotations

import contextlib
import io
import logging
import signal
import sys
import warnings

import torch

import dla_recipes
from dla_recipes.testing import tiny

SMALL = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": 128, "head_dim": 16, "max_position_embeddings": 256,
    "moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32, "ffn_hidden_size": 128, "d_ff": 128,
    "n_inner": 128, "pad_token_id": 127, "bos_token_id": 0, "eos_token_id": 1,
}


def tiny_config(model_type: str):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    layers = getattr(config, "num_hidden_layers", None)
    for name, value in SMALL.items():
        if hasattr(config, name):
            with contextlib.suppress(Exception):
                setattr(config, name, value)
    for name, value in list(vars(config).items()):  # per-layer lists follow the layer count
        if isinstance(value, list) and layers and len(value) == layers:
            setattr(config, name, value[:2])
    return config


def candidates() -> list[str]:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001, S112  (a model type whose config cannot be built is not surveyed)
            continue
        if getattr(config, "sub_configs", None) or getattr(config, "is_encoder_decoder", False):
            continue
        types.append(model_type)
    return types


class Timeout(Exception):
    pass


def _alarm(*_):
    raise Timeout("timed out")


def main(types: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    signal.signal(signal.SIGALRM, _alarm)
    for model_type in types:
        try:
            config = tiny_config(model_type)
            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(config)
            if any(".encoder." in f".{name}." for name, _ in meta.named_modules()):
                print(f"{model_type:28s} skip (an encoder used as a decoder)", flush=True)
                continue
            n = sum(p.numel() for p in meta.parameters())
            if n > 20_000_000:
                print(f"{model_type:28s} skip (tiny model has {n / 1e6:.0f}M parameters)", flush=True)
                continue
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).float().eval()
            with torch.no_grad():  # the shrunk config must give a model that runs before nnterp is blamed
                model(input_ids=torch.tensor([[2, 3, 4, 5]]))
        except Exception as error:  # noqa: BLE001
            print(f"{model_type:28s} skip ({type(error).__name__}: {str(error).splitlines()[0][:100]})", flush=True)
            continue
        signal.alarm(60)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                dla_recipes.load(model, tokenizer=tiny.tokenizer(), device_map="cpu")
            print(f"{model_type:28s} ok", flush=True)
        except Exception as error:  # noqa: BLE001
            text = " ".join(str(error).split())
            print(f"{model_type:28s} FAIL {type(error).__name__}: {text}", flush=True)
        finally:
            signal.alarm(0)


if __name__ == "__main__":
    main(sys.argv[1:] or candidates())
