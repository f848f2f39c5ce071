"""Explanations: the clean band and gallery (known answers, bundle round trip, refusals), the
Guard's per-block features, and the API behind the page (/v1/explain, /v1/gallery, /v1/stats) on
a live server."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from detector.bundle import MANIFEST_FILE, load_bundle, write_bundle
from detector.calibration import Calibration
from detector.errors import ArtefactError
from detector.explain import (
    EXPLAIN_FILE,
    CleanBand,
    Gallery,
    GalleryItem,
    block_features,
    to_uint8,
)
from detector.features import extract_features
from detector.guard import Guard
from service.activity import RecentActivity
from service.settings import Settings
from tests.live_server import LiveServer
from tests.service_helpers import API_KEY, CLASSES, encode, synthetic_images

KEYED = {"X-API-Key": API_KEY}


# ---- known answers ---------------------------------------------------------------------------
def test_block_features_take_the_interleaved_residue_columns() -> None:
    rows = np.array([[1.0, 2.0, 3.0, 4.0, 9.0], [5.0, 6.0, 7.0, 8.0, 9.0]])
    blocks = block_features(rows, n_blocks=2)
    assert blocks.shape == (2, 2, 2)
    np.testing.assert_array_equal(blocks[0], [[1.0, 3.0], [2.0, 4.0]])  # msq row, cos row
    np.testing.assert_array_equal(blocks[1], [[5.0, 7.0], [6.0, 8.0]])


def test_clean_band_quantiles_per_class_by_hand() -> None:
    blocks = np.zeros((6, 2, 1))
    blocks[:, 0, 0] = [1, 2, 3, 10, 20, 30]  # msq of block 0
    blocks[:, 1, 0] = [0.1, 0.2, 0.3, -0.1, -0.2, -0.3]  # cos of block 0
    labels = np.array([0, 0, 0, 2, 2, 2])
    band = CleanBand.fit(blocks, labels, n_classes=3, quantiles=(0.0, 0.5, 1.0))
    np.testing.assert_array_equal(band.counts, [3, 0, 3])
    assert band.for_class(0) == {
        "msq": [[1.0], [2.0], [3.0]],
        "cos": [[pytest.approx(0.1)], [pytest.approx(0.2)], [pytest.approx(0.3)]],
    }
    assert band.for_class(2)["msq"] == [[10.0], [20.0], [30.0]]
    assert band.for_class(1) is None and band.for_class(7) is None  # no clean image, no band


def test_to_uint8_rounds_as_a_png_would() -> None:
    np.testing.assert_array_equal(
        to_uint8(np.array([-0.1, 0.0, 0.5, 1.0, 2.0]), (0.0, 1.0)), [0, 0, 128, 255, 255]
    )
    np.testing.assert_array_equal(to_uint8(np.array([-1.0, 1.0]), (-1.0, 1.0)), [0, 255])


def test_recent_activity_buckets_and_histogram_by_hand() -> None:
    activity = RecentActivity()
    activity.record(np.array([0.1, 0.9]), np.array([False, True]), now=100.0)
    activity.record(np.array([0.5]), np.array([False]), now=115.0)
    activity.record(np.array([0.2]), np.array([False]), now=10.0)  # before the window
    summary = activity.summary(window_s=30.0, bucket_s=10.0, now=120.0)
    assert (summary["requests"], summary["images"], summary["flagged"]) == (2, 3, 1)
    assert summary["flag_rate"] == pytest.approx(1 / 3)
    assert [b["requests"] for b in summary["buckets"]] == [0, 1, 1]  # [90,100) [100,110) [110,120)
    histogram = summary["histogram"]
    assert sum(histogram["counts"]) == 3 and sum(histogram["flagged"]) == 1
    assert histogram["edges"][0] == pytest.approx(0.1) and histogram["edges"][-1] == 0.9
    assert histogram["flagged"][-1] == 1  # the 0.9 is in the last bin


def test_recent_activity_is_bounded() -> None:
    activity = RecentActivity(max_requests=50, max_scores=80)
    for i in range(1000):
        activity.record(np.array([0.1, 0.2]), np.array([False, False]), now=float(i))
    summary = activity.summary(window_s=3600.0, bucket_s=60.0, now=1000.0)
    assert summary["requests"] == 50 and sum(summary["histogram"]["counts"]) == 80


# ---- the bundle ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def explain_bundle(service_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The service's tiny bundle again, with a clean band (synthetic clean images) and a gallery."""
    plain = load_bundle(service_bundle)
    network = plain.model
    clean = synthetic_images(200, seed=11)
    features, logits = extract_features(network, clean)
    band = CleanBand.fit(block_features(features, n_blocks=2), logits.argmax(1), len(CLASSES))
    images = to_uint8(synthetic_images(3, seed=12), (0.0, 1.0))
    items = [GalleryItem(name=f"clean-{i}.png", kind="clean", source="test") for i in range(2)]
    items.append(GalleryItem(name="ood-noise-2.png", kind="ood", source="noise"))
    manifest = plain.manifest
    return write_bundle(
        tmp_path_factory.mktemp("explain") / "bundle",
        network_dir=service_bundle.parent / "network",
        detector=plain.detector,
        calibration=Calibration(
            threshold=manifest.threshold, target_fpr=manifest.target_fpr, achieved_fpr=0.1, n=40
        ),
        name="tiny-explained",
        version="7",
        dataset="synthetic",
        band=band,
        gallery=Gallery(items, images),
    )


def test_band_and_gallery_round_trip_through_the_bundle(explain_bundle: Path) -> None:
    manifest = json.loads((explain_bundle / MANIFEST_FILE).read_text())
    assert EXPLAIN_FILE in manifest["files"]
    assert manifest["explain"]["band_quantiles"] == [0.05, 0.25, 0.5, 0.75, 0.95]
    guard = Guard.from_bundle(explain_bundle, device="cpu")
    assert guard.band is not None and guard.band.values.shape == (10, 5, 2, 2)
    assert (
        guard.gallery is not None and [i.name for i in guard.gallery.items][-1] == "ood-noise-2.png"
    )
    np.testing.assert_array_equal(guard.gallery.images, to_uint8(synthetic_images(3, 12), (0, 1)))


def test_guard_blocks_are_the_residue_features_of_the_same_pass(explain_bundle: Path) -> None:
    guard = Guard.from_bundle(explain_bundle, device="cpu")
    x = synthetic_images(5, seed=13)
    result = guard.predict(x)
    features, _ = extract_features(guard.model, x)
    assert result.blocks is not None
    np.testing.assert_allclose(result.blocks, block_features(features, 2), rtol=1e-5, atol=1e-6)


def test_a_tampered_or_mismatched_explain_file_is_refused(explain_bundle: Path, tmp_path) -> None:
    import shutil

    tampered = tmp_path / "tampered"
    shutil.copytree(explain_bundle, tampered)
    data = bytearray((tampered / EXPLAIN_FILE).read_bytes())
    data[-1] ^= 0xFF
    (tampered / EXPLAIN_FILE).write_bytes(bytes(data))
    with pytest.raises(ArtefactError, match=f"checksum mismatch for bundle file {EXPLAIN_FILE}"):
        load_bundle(tampered)
    arrays = {"band.values": np.zeros((10, 5, 2, 3), np.float32)}
    arrays |= {"band.counts": np.ones(10, np.int64), "band.quantiles": np.linspace(0, 1, 5)}
    with pytest.raises(ArtefactError, match="belongs to another network"):
        CleanBand.from_arrays(arrays, n_classes=10, n_blocks=2)


# ---- the API behind the page ------------------------------------------------------------------
@pytest.fixture(scope="module")
def explained_server(explain_bundle: Path) -> Iterator[LiveServer]:
    settings = Settings(bundle=explain_bundle, device="cpu", api_key=API_KEY, query_memory="off")
    with LiveServer(settings) as live:
        yield live


def _pngs(n: int, seed: int) -> list[bytes]:
    arrays = (synthetic_images(n, seed)[:, 0] * 255).round().astype(np.uint8)
    return [encode(a) for a in arrays]


def test_explain_answers_as_predict_plus_the_guards_blocks_and_the_class_band(
    explained_server: LiveServer,
) -> None:
    blobs = _pngs(4, seed=21)
    files = [("files", (f"{i}.png", b, "image/png")) for i, b in enumerate(blobs)]
    with httpx.Client(base_url=explained_server.url, headers=KEYED) as client:
        explained = client.post("/v1/explain", files=files).json()
        predicted = client.post("/v1/predict", files=files).json()
    assert explained["blocks"] == ["blocks.0.residual", "blocks.1.residual"]
    assert explained["band_quantiles"] == [0.05, 0.25, 0.5, 0.75, 0.95]
    guard = explained_server.runtime.guard
    reference = guard.predict_images([np.asarray(Image.open(io.BytesIO(b))) for b in blobs])
    for row, (mine, theirs) in enumerate(
        zip(explained["results"], predicted["results"], strict=True)
    ):
        explanation = mine.pop("explanation")
        assert mine == theirs  # the same fields and values as /v1/predict
        msq, cos = reference.blocks[row]
        np.testing.assert_allclose(explanation["msq"], msq, rtol=1e-5)
        np.testing.assert_allclose(explanation["cos"], cos, rtol=1e-5, atol=1e-6)
        band = guard.band.for_class(mine["label"])
        assert band is not None and explanation["band"] == band  # exact: float32 values in JSON
        low, high = np.asarray(band["msq"])[[0, -1]]
        c_low, c_high = np.asarray(band["cos"])[[0, -1]]
        outside = (msq < low) | (msq > high) | (cos < c_low) | (cos > c_high)
        assert explanation["outside"] == np.flatnonzero(outside).tolist()


def test_explain_without_a_band_and_refusals(server: LiveServer) -> None:
    """The conftest server's bundle has no explain file: features without a band."""
    with httpx.Client(base_url=server.url) as client:
        assert (
            client.post("/v1/explain", files={"files": ("a.png", _pngs(1, 3)[0])}).status_code
            == 401
        )
        client.headers.update(KEYED)
        answer = client.post("/v1/explain", files={"files": ("a.png", _pngs(1, 3)[0])}).json()
        assert (
            answer["band_quantiles"] is None and answer["results"][0]["explanation"]["band"] is None
        )
        bad = client.post("/v1/explain", files={"files": ("x.png", b"not an image")})
        assert bad.status_code == 400 and "cannot decode" in bad.json()["error"]["message"]
        assert client.get("/v1/gallery").json() == {"samples": []}
        missing = client.get("/v1/gallery/0.png")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_gallery_serves_the_bundles_samples_as_pngs(explained_server: LiveServer) -> None:
    with httpx.Client(base_url=explained_server.url, headers=KEYED) as client:
        samples = client.get("/v1/gallery").json()["samples"]
        assert [s["kind"] for s in samples] == ["clean", "clean", "ood"]
        png = client.get(samples[2]["url"])
        assert png.headers["content-type"] == "image/png"
        pixels = np.asarray(Image.open(io.BytesIO(png.content)))
        expected = explained_server.runtime.guard.gallery.images[2, 0]
        np.testing.assert_array_equal(pixels, expected)
        assert client.get("/v1/gallery/3.png").status_code == 404


def test_stats_count_the_scored_requests(explained_server: LiveServer) -> None:
    with httpx.Client(base_url=explained_server.url, headers=KEYED) as client:
        before = client.get("/v1/stats").json()
        for blob in _pngs(3, seed=31):
            client.post("/v1/predict", files={"files": ("a.png", blob)})
        after = client.get("/v1/stats", params={"window_s": 60, "bucket_s": 5}).json()
        assert after["requests"] == before["requests"] + 3
        assert len(after["buckets"]) == 12 and after["threshold"] == pytest.approx(
            explained_server.runtime.guard.threshold
        )
        assert client.get("/v1/stats", params={"window_s": 1}).status_code == 422


def test_the_page_and_its_assets_are_served_with_a_strict_csp(server: LiveServer) -> None:
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "/static/app.js" in page.text and "http" not in page.text.split("<body>")[0]
    sizes = [len(httpx.get(server.url + f"/static/{n}").content) for n in ("app.js", "style.css")]
    assert all(size > 1000 for size in sizes)
    assert len(page.content) + sum(sizes) < 100_000  # the page's size budget
    schema = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert {"/v1/explain", "/v1/gallery", "/v1/gallery/{index}.png", "/v1/stats"} <= set(schema)
