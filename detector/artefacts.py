"""Artefact I/O: the one place that writes and reads files lapguard keeps.

Every write is atomic (a temporary file beside the target, then ``os.replace``), so an
interrupted run leaves either the old file or the new one, never half of one. Arrays travel as
safetensors or ``.npz`` read with ``allow_pickle=False``; everything else is JSON. Nothing is ever
unpickled. Read errors become :class:`~detector.errors.ArtefactError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError
from safetensors import SafetensorError
from safetensors.numpy import load_file as _load_numpy
from safetensors.numpy import save_file as _save_numpy

from detector.errors import ArtefactError, validation_problems

ModelT = TypeVar("ModelT", bound=BaseModel)

_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------
# Checksums
# --------------------------------------------------------------------------------------------
def sha256_bytes(*chunks: bytes) -> str:
    """Hex sha256 of the concatenated ``chunks``."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(payload: Any) -> str:
    """Hex sha256 of ``payload`` as canonical JSON (sorted keys): a stable configuration key."""
    return sha256_bytes(json.dumps(payload, sort_keys=True).encode())


# --------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------
@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically, on
    an exception it is removed and ``path`` is left as it was. Parent folders are created."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, payload: Any, *, indent: int | None = 2) -> Path:
    """Write ``payload`` as JSON to ``path`` atomically."""
    return write_text(path, json.dumps(payload, indent=indent))


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Write ``rows`` as JSON lines to ``path`` atomically (the whole file, not an append)."""
    return write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def save_npz(path: str | Path, **arrays: np.ndarray) -> Path:
    """Write arrays as an uncompressed ``.npz`` atomically (the name is kept as given)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.savez(handle, allow_pickle=False, **arrays)
    return Path(path)


def save_arrays(
    path: str | Path, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> Path:
    """Write numpy arrays as safetensors atomically."""
    contiguous = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    with atomic_path(path) as tmp:
        _save_numpy(contiguous, str(tmp), metadata=metadata)
    return Path(path)


# --------------------------------------------------------------------------------------------
# Reads
# --------------------------------------------------------------------------------------------
def read_json(path: str | Path, *, what: str = "file") -> Any:
    """Parse a JSON file; a missing or corrupt file raises ArtefactError naming it."""
    file = Path(path)
    if not file.is_file():
        raise ArtefactError(f"{what} {file} does not exist")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as error:
        raise ArtefactError(f"{what} {file} is not valid JSON: {error}") from error


def read_model(path: str | Path, model: type[ModelT], *, what: str = "file") -> ModelT:
    """A pydantic model saved as JSON; a missing, corrupt or invalid file raises ArtefactError
    naming it (a run directory's saved config, a set's manifest)."""
    data = read_json(path, what=what)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = validation_problems(error.errors())
        raise ArtefactError(f"{what} {path} is not a valid {model.__name__}: {problems}") from error


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every JSON line of a file (blank lines skipped); [] when the file does not exist. A
    corrupt line raises ArtefactError with its line number."""
    file = Path(path)
    if not file.is_file():
        return []
    try:
        text = file.read_text()
    except UnicodeDecodeError as error:
        raise ArtefactError(f"{file} is not text: {error}") from error
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ArtefactError(f"{file}:{number} is not valid JSON: {error}") from error
    return rows


def append_jsonl(path: str | Path, row: dict[str, Any]) -> None:
    """Append one JSON line (appends are not atomic; readers skip nothing but blank lines)."""
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")


def load_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` (never unpickled); unreadable files raise ArtefactError."""
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # one .npy array, not an archive
            raise ValueError("it holds a single .npy array, not an .npz archive of arrays")
        with loaded as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise ArtefactError(f"cannot read {path}: {error}") from error


def load_cache(path: str | Path, keys: Iterable[str]) -> dict[str, np.ndarray] | None:
    """A cache file's arrays when it exists, reads and holds every one of ``keys``; None (to
    compute it again) when it is absent, corrupt or of another layout."""
    if not Path(path).is_file():
        return None
    try:
        cached = load_npz(path)
    except ArtefactError:
        return None
    return cached if all(k in cached for k in keys) else None


def load_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """Numpy arrays from a safetensors file; unreadable files raise ArtefactError."""
    try:
        return _load_numpy(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise ArtefactError(f"cannot read {path}: {error}") from error
