"""The artefact I/O module: atomic writes, checksums and safe array files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from detector import artefacts
from detector.errors import ArtefactError


def test_sha256_matches_hashlib(tmp_path: Path) -> None:
    data = bytes(range(256)) * 5000  # > one 1 MiB read block
    path = artefacts.write_bytes(tmp_path / "blob", data)
    expected = hashlib.sha256(data).hexdigest()
    assert artefacts.sha256_file(path) == expected
    assert artefacts.sha256_bytes(data[:100], data[100:]) == expected
    assert artefacts.sha256_json({"b": 1, "a": 2}) == artefacts.sha256_json({"a": 2, "b": 1})


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = artefacts.write_text(tmp_path / "sub" / "x.json", "old")
    with pytest.raises(RuntimeError), artefacts.atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.json"]


def test_json_npz_and_safetensors_round_trip(tmp_path: Path) -> None:
    artefacts.write_json(tmp_path / "a.json", {"k": [1, 2]})
    assert artefacts.read_json(tmp_path / "a.json") == {"k": [1, 2]}
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    loaded = artefacts.load_npz(artefacts.save_npz(tmp_path / "a.npz", x=x, s=np.array("key")))
    assert np.array_equal(loaded["x"], x) and str(loaded["s"]) == "key"
    loaded = artefacts.load_arrays(artefacts.save_arrays(tmp_path / "a.safetensors", {"x": x.T}))
    assert np.array_equal(loaded["x"], x.T)


def test_corrupt_and_missing_files_raise_artefact_errors_naming_them(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 truncated")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 7)
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n\n{"a": \n')
    with pytest.raises(ArtefactError, match="bad.json"):
        artefacts.read_json(tmp_path / "bad.json")
    with pytest.raises(ArtefactError, match="does not exist"):
        artefacts.read_json(tmp_path / "missing.json", what="run config")
    with pytest.raises(ArtefactError, match="bad.npz"):
        artefacts.load_npz(tmp_path / "bad.npz")
    with pytest.raises(ArtefactError, match="bad.safetensors"):
        artefacts.load_arrays(tmp_path / "bad.safetensors")
    with pytest.raises(ArtefactError, match="bad.jsonl:3"):
        artefacts.read_jsonl(tmp_path / "bad.jsonl")
    assert artefacts.read_jsonl(tmp_path / "none.jsonl") == []


def test_write_jsonl_replaces_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    artefacts.append_jsonl(path, {"old": True})
    rows = [{"epoch": 1, "x": 0.5}, {"epoch": 2, "x": None}]
    artefacts.write_jsonl(path, rows)
    assert path.read_text() == '{"epoch": 1, "x": 0.5}\n{"epoch": 2, "x": null}\n'
    assert artefacts.read_jsonl(path) == rows
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


def test_corrupt_files_of_the_wrong_kind_are_artefact_errors(tmp_path: Path) -> None:
    """A .npy saved where an .npz belongs, and bytes that are not text in a JSON-lines file, are
    errors naming the file (they were a TypeError and a UnicodeDecodeError)."""
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "one.npy").rename(tmp_path / "one.npz")
    with pytest.raises(ArtefactError, match="one.npz.*single .npy array"):
        artefacts.load_npz(tmp_path / "one.npz")
    (tmp_path / "rows.jsonl").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ArtefactError, match="rows.jsonl is not text"):
        artefacts.read_jsonl(tmp_path / "rows.jsonl")


def test_a_cache_that_is_absent_corrupt_or_of_another_layout_reads_as_none(tmp_path: Path) -> None:
    path = tmp_path / "cache.npz"
    assert artefacts.load_cache(path, ["a"]) is None
    path.write_bytes(b"PK\x03\x04 cut short")
    assert artefacts.load_cache(path, ["a"]) is None
    artefacts.save_npz(path, a=np.arange(3))
    assert artefacts.load_cache(path, ["a", "b"]) is None
    np.testing.assert_array_equal(artefacts.load_cache(path, ["a"])["a"], np.arange(3))
