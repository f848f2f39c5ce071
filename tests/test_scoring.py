"""Batch scoring (`lapguard score`): inputs, error rows, JSONL/CSV, resume, the HTTP client against
a real server on loopback, and the Ray engine; all on the tiny real bundle of the service tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from detector.images import decode_image
from service.batch import (
    RESULT_KEYS,
    InMemoryInput,
    discover_inputs,
    read_output,
    run_scoring,
    score_inputs,
)
from service.batch.http import HttpScorer, drive_results, score_url
from service.settings import Settings
from tests.live_server import LiveServer
from tests.service_helpers import CLASSES, STRICT_TARGET_FPR, encode, synthetic_images
from training.cli.main import main as cli_main


@pytest.fixture(scope="module")
def guard(service_bundle: Path):
    from detector.guard import Guard

    return Guard.from_bundle(service_bundle, device="cpu")


@pytest.fixture(scope="module")
def pixels() -> np.ndarray:
    """Twelve 28x28 uint8 grayscale images."""
    return (synthetic_images(12, seed=5)[:, 0] * 255).round().astype(np.uint8)


@pytest.fixture()
def folder(tmp_path: Path, pixels: np.ndarray) -> Path:
    """Images in a folder and a sub-folder, one corrupt PNG, and a file that is not an image."""
    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    for i, image in enumerate(pixels[:6]):
        (root / ("sub" if i % 2 else "") / f"img{i:02d}.png").write_bytes(encode(image))
    (root / "img03x.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (root / "notes.txt").write_text("not an image")
    return root


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_same_rows(rows: list[dict], reference: list[dict]) -> None:
    """Same inputs in the same order with the same results (floats to 1e-5, batches differ)."""
    assert [(r.get("path"), r.get("index")) for r in rows] == [
        (r.get("path"), r.get("index")) for r in reference
    ]
    for row, ref in zip(rows, reference, strict=True):
        assert ("error" in row) == ("error" in ref), (row, ref)
        if "error" in ref:
            continue
        assert set(row) - {"path", "index"} == set(RESULT_KEYS)
        assert (row["label"], row["class_name"], row["flagged"]) == (
            ref["label"],
            ref["class_name"],
            ref["flagged"],
        )
        for key in ("confidence", "score", "threshold"):
            assert row[key] == pytest.approx(ref[key], abs=1e-5)


def expected_rows(guard, images: list[np.ndarray]) -> list[dict]:
    result = guard.predict_images(images)
    return [
        {
            "label": int(result.labels[i]),
            "class_name": CLASSES[int(result.labels[i])],
            "confidence": float(result.confidences[i]),
            "flagged": bool(result.flagged[i]),
            "score": float(result.scores[i]),
            "threshold": result.threshold,
        }
        for i in range(len(images))
    ]


# ---- local scoring -----------------------------------------------------------------------------
def test_folder_with_a_corrupt_file_gives_an_error_row_and_correct_rows(
    guard, folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    summary = score_inputs(guard, [folder], out, batch_size=4, num_workers=2, progress=False)
    rows = read_jsonl(out)
    paths = [row["path"] for row in rows]
    assert paths == sorted(str(p) for p in folder.rglob("*.png"))  # recursive, by extension
    bad = [row for row in rows if "error" in row]
    assert [row["path"] for row in bad] == [str(folder / "img03x.png")]
    assert set(bad[0]) == {"path", "error"} and "corrupt" in bad[0]["error"]
    good = [row for row in rows if "error" not in row]
    images = [decode_image(Path(row["path"]).read_bytes()) for row in good]
    assert_same_rows(
        good,
        [{"path": r["path"], **e} for r, e in zip(good, expected_rows(guard, images), strict=True)],
    )
    assert (summary.count, summary.scored, summary.errors, summary.new) == (7, 6, 1, 7)
    assert summary.flagged == sum(row["flagged"] for row in good)
    assert summary.throughput > 0 and "errors 1" in str(summary)


def test_arrays_in_several_layouts_and_bad_inputs(
    guard, pixels: np.ndarray, tmp_path: Path
) -> None:
    floats = pixels[:4].astype(np.float32) / 255.0
    np.save(tmp_path / "nchw.npy", floats[:, None])  # float [N, 1, H, W]
    np.savez(tmp_path / "nhwc.npz", images=pixels[4:7, :, :, None])  # uint8 [N, H, W, 1]
    out_of_range = floats[:2].copy()
    out_of_range[1] *= 3.0  # floats above the value range: that image cannot be scored
    np.save(tmp_path / "nhw.npy", out_of_range)  # float [N, H, W]
    np.save(tmp_path / "flat.npy", np.zeros(10, np.float32))  # not a stack of images
    inputs = [tmp_path / n for n in ("nchw.npy", "nhwc.npz", "nhw.npy", "flat.npy")]
    out = tmp_path / "out.jsonl"
    summary = score_inputs(guard, inputs, out, batch_size=3, num_workers=0, progress=False)
    rows = read_jsonl(out)
    keys = [(Path(r["path"]).name, r.get("index")) for r in rows]
    assert keys == [("nchw.npy", i) for i in range(4)] + [("nhwc.npz", i) for i in range(3)] + [
        ("nhw.npy", 0),
        ("nhw.npy", 1),
        ("flat.npy", None),
    ]
    assert "value range" in rows[8]["error"] and "stack of images" in rows[9]["error"]
    reference = expected_rows(guard, [*floats, *pixels[4:7], out_of_range[0]])
    assert_same_rows(
        [r for r in rows if "error" not in r],
        [
            {"path": r["path"], "index": r["index"], **e}
            for r, e in zip(rows, reference, strict=False)
        ],
    )
    assert (summary.scored, summary.errors) == (8, 2)
    # One array alone: rows carry the index only.
    single = tmp_path / "single.jsonl"
    score_inputs(guard, [tmp_path / "nchw.npy"], single, num_workers=0, progress=False)
    assert [set(r) for r in read_jsonl(single)] == [{"index", *RESULT_KEYS}] * 4


def test_csv_output_and_in_memory_data_set(guard, pixels: np.ndarray, tmp_path: Path) -> None:
    import torch
    from torch.utils.data import TensorDataset

    data = TensorDataset(
        torch.from_numpy(pixels[:5, None].astype(np.float32) / 255), torch.zeros(5)
    )
    out = tmp_path / "out.csv"
    summary = score_inputs(
        guard,
        [InMemoryInput("tiny", data)],
        out,
        fmt="csv",
        batch_size=2,
        num_workers=1,
        progress=False,
    )
    lines = out.read_text().splitlines()
    assert lines[0] == "index,label,class_name,confidence,flagged,score,threshold,error"
    rows = read_output(out, "csv", lines[0].split(","))
    reference = expected_rows(guard, list(pixels[:5]))
    assert [int(r["index"]) for r in rows] == list(range(5))
    assert [int(r["label"]) for r in rows] == [e["label"] for e in reference]
    assert [r["flagged"] for r in rows] == [e["flagged"] for e in reference]
    np.testing.assert_allclose(
        [float(r["score"]) for r in rows], [e["score"] for e in reference], atol=1e-5
    )
    assert all(r["error"] == "" for r in rows) and summary.scored == 5


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_interrupted_run_resumes_without_duplicates(
    guard, folder: Path, pixels: np.ndarray, tmp_path: Path, fmt: str
) -> None:
    np.save(tmp_path / "more.npy", pixels)
    inputs = [folder, tmp_path / "more.npy"]
    full = tmp_path / f"full.{fmt}"
    score_inputs(guard, inputs, full, fmt=fmt, batch_size=4, num_workers=0, progress=False)
    lines = full.read_bytes().split(b"\n")
    # Killed mid-write: 8 complete lines (CSV: header + 7 rows), then half of the next line.
    partial = tmp_path / f"partial.{fmt}"
    partial.write_bytes(b"\n".join(lines[:8]) + b"\n" + lines[8][: len(lines[8]) // 2])
    summary = score_inputs(
        guard, inputs, partial, fmt=fmt, batch_size=5, num_workers=1, progress=False
    )
    assert summary.resumed == 8 - (fmt == "csv") and summary.count == 19
    assert summary.new == summary.count - summary.resumed
    columns = lines[0].decode().split(",") if fmt == "csv" else []
    resumed, reference = read_output(partial, fmt, columns), read_output(full, fmt, columns)
    if fmt == "csv":  # compare as typed values
        resumed, reference = [typed(r) for r in resumed], [typed(r) for r in reference]
    keys = [(r.get("path"), r.get("index")) for r in resumed]
    assert len(keys) == len(set(keys)) == 19  # every input exactly once
    assert_same_rows(resumed, reference)
    # Finished: a re-run is a no-op.
    before = partial.read_bytes()
    again = score_inputs(guard, inputs, partial, fmt=fmt, num_workers=0, progress=False)
    assert (again.new, again.resumed) == (0, 19) and partial.read_bytes() == before


def test_run_stopped_by_an_interruption_keeps_whole_batches_and_resumes(
    guard, pixels: np.ndarray, tmp_path: Path
) -> None:
    from service.batch.local import local_results

    np.save(tmp_path / "x.npy", pixels)
    out = tmp_path / "out.jsonl"

    def interrupted(pending):
        for number, rows in enumerate(local_results(guard, pending, batch_size=5, num_workers=1)):
            if number == 2:
                raise KeyboardInterrupt
            yield rows

    with pytest.raises(KeyboardInterrupt):
        run_scoring([tmp_path / "x.npy"], out, interrupted, progress=False)
    assert [r["index"] for r in read_jsonl(out)] == list(range(10))
    summary = score_inputs(guard, [tmp_path / "x.npy"], out, num_workers=0, progress=False)
    assert (summary.resumed, summary.new) == (10, 2)
    assert [r["index"] for r in read_jsonl(out)] == list(range(12))


def typed(row: dict) -> dict:
    """A CSV row (strings) with JSONL's types; empty cells dropped."""
    kinds = {"index": int, "label": int, "confidence": float, "score": float, "threshold": float}
    return {k: kinds[k](v) if k in kinds else v for k, v in row.items() if v != ""}


def test_retry_errors_rescore_only_the_error_rows(
    guard, folder: Path, pixels, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    score_inputs(guard, [folder], out, num_workers=0, progress=False)
    (folder / "img03x.png").write_bytes(encode(pixels[11]))  # fixed since
    assert score_inputs(guard, [folder], out, num_workers=0, progress=False).new == 0
    summary = score_inputs(guard, [folder], out, num_workers=0, progress=False, retry_errors=True)
    assert (summary.new, summary.errors, summary.scored) == (1, 0, 7)
    rows = read_jsonl(out)
    assert len(rows) == 7 and rows[-1]["path"].endswith("img03x.png") and "label" in rows[-1]


def test_missing_input_and_nothing_to_score(tmp_path: Path) -> None:
    from detector.errors import DataNotFoundError

    with pytest.raises(DataNotFoundError, match="does not exist"):
        discover_inputs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataNotFoundError, match="no inputs to score"):
        discover_inputs([tmp_path / "empty"])


def test_an_output_directory_is_refused_naming_a_file(guard, folder, tmp_path) -> None:
    from detector.errors import ConfigError

    with pytest.raises(ConfigError, match="is a directory; name the output file"):
        score_inputs(guard, [folder], tmp_path, num_workers=0, progress=False)
    assert list(tmp_path.iterdir()) == [folder]


def test_an_output_that_is_not_ours_is_refused_and_left_as_it_is(guard, folder, tmp_path) -> None:
    from detector.errors import ArtefactError

    for name, content in (
        ("image.jsonl", encode(np.zeros((4, 4), np.uint8))),
        ("notes.jsonl", b"a\nb\n"),
    ):
        out = tmp_path / name
        out.write_bytes(content)
        with pytest.raises(ArtefactError, match="choose another --out"):
            score_inputs(guard, [folder], out, num_workers=0, progress=False)
        assert out.read_bytes() == content


def test_score_command(
    service_bundle: Path, folder: Path, tmp_path: Path, capsys, data_root
) -> None:
    out = tmp_path / "cli.csv"
    argv = ["score", "--bundle", str(service_bundle), str(folder), "--out", str(out)]
    assert cli_main([*argv, "--workers", "0", "--no-progress", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "7 inputs" in printed and "errors 1" in printed
    assert out.read_text().splitlines()[0].startswith("path,label,")  # CSV from the suffix
    # A data set by name (first N images), rows keyed by index.
    data_out = tmp_path / "fm.jsonl"
    argv = ["score", "--bundle", str(service_bundle), "--dataset", "fashion-mnist", "--n", "20"]
    assert cli_main([*argv, "--root", str(data_root), "--out", str(data_out), "--no-progress"]) == 0
    assert [r["index"] for r in read_jsonl(data_out)] == list(range(20))
    capsys.readouterr()
    assert cli_main(["score", "--bundle", str(service_bundle), str(tmp_path / "nope.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["score", "--url", "http://127.0.0.1:9", "--engine", "ray", str(folder)]) == 2
    assert "--engine ray needs --bundle" in capsys.readouterr().err
    argv = ["score", "--url", "http://127.0.0.1:9", "--target-fpr", "0.01", str(folder)]
    assert cli_main(argv) == 2
    assert "lapguard serve --target-fpr" in capsys.readouterr().err  # the server decides
    argv = ["score", "--bundle", str(service_bundle), "--target-fpr", "0.01", str(folder)]
    assert cli_main([*argv, "--out", str(tmp_path / "strict.jsonl")]) == 2
    assert "no operating point at target FPR 0.01" in capsys.readouterr().err
    loose = tmp_path / "loose.jsonl"
    argv = ["score", "--bundle", str(service_bundle), "--target-fpr", str(STRICT_TARGET_FPR)]
    assert cli_main([*argv, str(folder), "--out", str(loose), "--no-progress"]) == 0
    manifest = json.loads((service_bundle / "manifest.json").read_text())
    at = {p["target_fpr"]: p["threshold"] for p in manifest["operating_points"]}
    rows = [r for r in read_jsonl(loose) if "score" in r]
    assert rows and all(r["threshold"] == at[STRICT_TARGET_FPR] != at[0.1] for r in rows)
    assert all(r["flagged"] == (r["score"] > at[STRICT_TARGET_FPR]) for r in rows)


# ---- over HTTP ---------------------------------------------------------------------------------
def test_url_gives_the_same_rows_as_in_process(
    service_bundle: Path, guard, folder: Path, pixels: np.ndarray, tmp_path: Path
) -> None:
    np.save(tmp_path / "floats.npy", pixels[:5, None].astype(np.float32) / 255)
    np.save(tmp_path / "bytes.npy", pixels[5:9])
    inputs = [folder, tmp_path / "floats.npy", tmp_path / "bytes.npy"]
    local = tmp_path / "local.jsonl"
    score_inputs(guard, inputs, local, num_workers=0, progress=False)
    settings = Settings(
        bundle=service_bundle,
        device="cpu",
        api_key="k",
        max_batch_size=4,
        max_images_per_request=4,
        max_queue=8,
    )
    remote = tmp_path / "remote.jsonl"
    with LiveServer(settings) as server:
        summary = score_url(
            server.url, inputs, remote, batch_size=6, concurrency=3, api_key="k", progress=False
        )
        with pytest.raises(Exception, match="API key"):
            score_url(server.url, inputs, tmp_path / "x.jsonl", progress=False)
    assert_same_rows(read_jsonl(remote), read_jsonl(local))
    assert (summary.count, summary.errors) == (16, 1)  # batches of 6 > 4 allowed: split, not lost


def _fake_server(script: Iterator[str | None]):
    """A MockTransport serving /v1/model, and /v1/predict per ``script``: "503", "connect", or
    None (answer with one result per file, class 1)."""
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/model":
            return httpx.Response(
                200,
                json={"name": "m", "class_names": CLASSES, "input_spec": {"value_range": [0, 1]}},
            )
        action = next(script, None)
        calls.append(1)
        if action == "503":
            return httpx.Response(
                503,
                headers={"Retry-After": "0"},
                json={"error": {"code": "not_ready", "message": "warming up"}},
            )
        if action == "connect":
            raise httpx.ConnectError("connection refused", request=request)
        count = request.content.count(b'name="files"')
        result = {
            "label": 1,
            "class_name": CLASSES[1],
            "confidence": 0.5,
            "flagged": False,
            "score": 0.1,
            "threshold": 0.4,
        }
        return httpx.Response(200, json={"results": [{"index": i, **result} for i in range(count)]})

    return httpx.MockTransport(handler), calls


def _score_with(transport, inputs, out: Path, retries: int):
    scorer = HttpScorer("http://test", retries=retries, backoff_s=0.001, transport=transport)
    return run_scoring(
        inputs,
        out,
        lambda pending: drive_results(scorer.results(pending, batch_size=10)),
        progress=False,
    )


def test_client_retries_on_503_then_reports_connection_errors_per_input(
    folder: Path, tmp_path: Path
) -> None:
    transport, calls = _fake_server(iter(["503", "503", None]))
    summary = _score_with(transport, [folder], tmp_path / "a.jsonl", retries=2)
    assert len(calls) == 3 and (summary.scored, summary.errors) == (7, 0)

    transport, calls = _fake_server(iter(["connect"] * 3))
    summary = _score_with(transport, [folder], tmp_path / "b.jsonl", retries=2)
    rows = read_jsonl(tmp_path / "b.jsonl")
    assert len(calls) == 3 and summary.errors == 7 and len(rows) == 7
    assert all("connection error" in r["error"] and "3 attempts" in r["error"] for r in rows)


# ---- Ray ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ray_engine_gives_the_same_rows_as_in_process(
    service_bundle: Path, guard, folder: Path, pixels: np.ndarray, tmp_path: Path
) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'lapguard[ray]')")
    from detector.guard import Guard
    from service.batch.ray import score_inputs_ray

    """The actors flag at the operating point the driver was asked for, as a local Guard does."""
    np.save(tmp_path / "more.npy", pixels)
    inputs = [folder, tmp_path / "more.npy"]
    local = tmp_path / "local.jsonl"
    loose = Guard.from_bundle(service_bundle, device="cpu", target_fpr=STRICT_TARGET_FPR)
    score_inputs(loose, inputs, local, num_workers=0, progress=False)
    distributed = tmp_path / "ray.jsonl"
    summary = score_inputs_ray(
        service_bundle,
        inputs,
        distributed,
        batch_size=4,
        num_actors=2,
        device="cpu",
        target_fpr=STRICT_TARGET_FPR,
        progress=False,
    )
    rows = read_jsonl(distributed)
    assert_same_rows(rows, read_jsonl(local))
    assert {r["threshold"] for r in rows if "threshold" in r} == {loose.threshold}
    assert loose.threshold != guard.threshold
    assert (summary.count, summary.errors) == (19, 1)


def test_client_reads_v2_errors_in_their_own_shape(pixels: np.ndarray, tmp_path: Path) -> None:
    """Array items go to /v2 infer; its refusals are ``{"error": "message"}`` (Open Inference
    Protocol), not /v1's ``{"error": {"code", "message"}}``: the row carries the message."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/model":
            return httpx.Response(
                200,
                json={"name": "m", "class_names": CLASSES, "input_spec": {"value_range": [0, 1]}},
            )
        assert request.url.path == "/v2/models/m/infer"
        return httpx.Response(400, json={"error": "input 'input': bad pixels", "code": "bad"})

    np.save(tmp_path / "x.npy", pixels[:2])
    summary = _score_with(
        httpx.MockTransport(handler), [tmp_path / "x.npy"], tmp_path / "out.jsonl", retries=0
    )
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert summary.errors == 2
    assert [r["error"] for r in rows] == ["HTTP 400: input 'input': bad pixels"] * 2
