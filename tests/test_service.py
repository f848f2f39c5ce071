"""Integration tests of the detection service: the real app under uvicorn on a loopback port, on a
tiny real bundle, driven over HTTP with httpx (and a stock KServe v2 client when installed)."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from detector.images import decode_image
from detector.networks import InputSpec, NetworkConfig, build_network, save
from service.app import create_app
from service.server import build_server
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key-123"
CLASSES = [f"class_{i}" for i in range(10)]
LIMITS = {"max_body_bytes": 200_000, "max_images_per_request": 8, "max_pixels": 512 * 512}


# ---- fixtures: a tiny real bundle and a live server --------------------------------------------
def synthetic_images(n: int, seed: int) -> np.ndarray:
    """Smooth seeded blobs, float32 [n, 1, 28, 28] in [0, 1]."""
    rng = np.random.default_rng(seed)
    coarse = torch.from_numpy(rng.random((n, 1, 7, 7), dtype=np.float32))
    return torch.nn.functional.interpolate(coarse, size=(28, 28), mode="bilinear").numpy()


@pytest.fixture(scope="module")
def service_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """network (2 blocks, seeded) + transport forest fitted on clean vs noised images + threshold."""
    from detector.bundle import write_bundle
    from detector.calibration import Calibration, calibrate_threshold, empirical_fpr
    from detector.features import extract_features
    from detector.forest import TransportDetector

    tmp = tmp_path_factory.mktemp("service")
    config = NetworkConfig(
        architecture="resnet9_mnist",
        arguments={"width": 4, "depth": 2, "hidden": 8},
        class_names=CLASSES,
        input_spec=InputSpec(channels=1, height=28, width=28, mean=[0.2860], std=[0.3530]),
    )
    torch.manual_seed(0)
    save(build_network(config).eval(), tmp / "network", config)
    from detector.networks import load

    network = load(tmp / "network")
    clean = synthetic_images(160, seed=1)
    noisy = np.clip(clean + np.random.default_rng(2).normal(0, 0.25, clean.shape), 0, 1).astype(
        np.float32
    )
    f_clean, l_clean = extract_features(network, clean)
    f_noisy, l_noisy = extract_features(network, noisy)
    fit, held = slice(0, 120), slice(120, None)
    detector = TransportDetector(
        n_estimators=10, max_depth=4, min_class_samples=5, random_state=0
    ).fit(
        np.concatenate([f_clean[fit], f_noisy[fit]]),
        np.concatenate([np.zeros(120, bool), np.ones(120, bool)]),
        np.concatenate([l_clean[fit].argmax(1), l_noisy[fit].argmax(1)]),
    )
    scores = detector.score(f_clean[held], l_clean[held].argmax(1))
    threshold = calibrate_threshold(scores, 0.1)
    calibration = Calibration(
        threshold=threshold,
        target_fpr=0.1,
        achieved_fpr=empirical_fpr(scores, threshold),
        n=len(scores),
    )
    return write_bundle(
        tmp / "bundle",
        network_dir=tmp / "network",
        detector=detector,
        calibration=calibration,
        name="tiny",
        version="7",
        dataset="synthetic",
        metrics={"test_accuracy": 0.1},
    )


@pytest.fixture(scope="module")
def guard(service_bundle: Path):
    from detector.guard import Guard

    return Guard.from_bundle(service_bundle, device="cpu")


class LiveServer:
    """The app under uvicorn in a background thread, on a socket bound to 127.0.0.1:<free port>."""

    def __init__(self, settings: Settings, guard=None, wait_for: str = "/readyz") -> None:
        self.wait_for = wait_for
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.settings = settings.model_copy(update={"host": "127.0.0.1", "port": self.port})
        self.app = create_app(self.settings, guard=guard)
        self.server = build_server(self.settings, self.app)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def runtime(self):
        return self.app.state.runtime

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.thread.is_alive():
            try:
                if httpx.get(self.url + self.wait_for, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"the server did not become ready: {self.runtime.startup_error or 'timed out after 60 s'}"
        )

    def stop(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)  # what SIGTERM does: drain, then exit
        self.thread.join(timeout=30)
        self.socket.close()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def server(service_bundle: Path) -> Iterator[LiveServer]:
    """Loads the bundle itself in its lifespan (like `lapguard serve`), with an API key and small limits."""
    settings = Settings(
        bundle=service_bundle,
        device="cpu",
        api_key=API_KEY,
        max_batch_size=8,
        max_wait_ms=2,
        **LIMITS,
    )
    with LiveServer(settings) as live:
        yield live


@pytest.fixture()
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"X-API-Key": API_KEY}, timeout=30) as c:
        yield c


def encode(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    """Five 28x28 grayscale PNGs, a 40x40 RGB JPEG and a 320x240 RGB PNG (converted by the Guard:
    the large one takes the decode-in-a-thread path), a GIF."""
    arrays = (synthetic_images(6, seed=3)[:, 0] * 255).round().astype(np.uint8)
    blobs = [encode(a) for a in arrays[:5]]
    rgb = np.random.default_rng(4).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    large = np.asarray(Image.fromarray(rgb).resize((320, 240), Image.BILINEAR))
    return [*blobs, encode(rgb, "JPEG"), encode(large), encode(arrays[5], "GIF")]


def expected(guard, blobs: list[bytes]):
    return guard.predict_images([decode_image(b, max_pixels=LIMITS["max_pixels"]) for b in blobs])


def assert_matches(
    results: list[dict], reference, filenames: list[str | None] | None = None
) -> None:
    assert [r["index"] for r in results] == list(range(len(results)))
    assert [r["label"] for r in results] == reference.labels.tolist()
    assert [r["class_name"] for r in results] == [CLASSES[i] for i in reference.labels]
    assert [r["flagged"] for r in results] == reference.flagged.tolist()
    np.testing.assert_allclose([r["confidence"] for r in results], reference.confidences, atol=1e-5)
    np.testing.assert_allclose([r["score"] for r in results], reference.scores, atol=1e-5)
    assert all(r["threshold"] == pytest.approx(reference.threshold) for r in results)
    if filenames is not None:
        assert [r["filename"] for r in results] == filenames
    keys = {
        "index",
        "filename",
        "label",
        "class_name",
        "confidence",
        "flagged",
        "score",
        "threshold",
    }
    assert all(set(r) == keys for r in results)


# ---- decoding (detector.images, shared with batch scoring) ---------------------------------------
@pytest.mark.parametrize(
    ("mode", "keep_alpha", "shape"),
    [("L", False, (9, 7)), ("RGB", False, (9, 7, 3)), ("RGBA", False, (9, 7, 3)), ("RGBA", True, (9, 7, 4)),
     ("I;16", False, (9, 7)), ("1", False, (9, 7)), ("P", False, (9, 7, 3))],
)  # fmt: skip
def test_decode_image_modes(mode: str, keep_alpha: bool, shape: tuple[int, ...]) -> None:
    image = Image.new(mode, (7, 9))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    array = decode_image(buffer.getvalue(), max_pixels=100, keep_alpha=keep_alpha)
    assert array.shape == shape and array.dtype == np.uint8


def test_decode_image_16_bit_is_scaled_not_clipped() -> None:
    buffer = io.BytesIO()
    Image.fromarray(np.full((4, 4), 65535, np.uint16)).save(buffer, "PNG")
    assert decode_image(buffer.getvalue(), max_pixels=100).max() == 255


def test_decode_image_refuses_before_decoding() -> None:
    from detector.errors import InputError, InputTooLargeError, UnsupportedMediaError

    with pytest.raises(InputTooLargeError, match="more than the limit"):
        decode_image(_bomb(), max_pixels=512 * 512)
    with pytest.raises(UnsupportedMediaError, match="ICO"):
        decode_image(_ico(), max_pixels=10_000)
    with pytest.raises(UnsupportedMediaError, match="JPEG is not accepted"):
        decode_image(encode(np.zeros((4, 4), np.uint8), "JPEG"), max_pixels=100, formats=("PNG",))
    noise = np.random.default_rng(0).integers(0, 256, (40, 40), dtype=np.uint8)
    for bad in (b"", b"not an image", encode(noise)[:300]):
        with pytest.raises(InputError):
            decode_image(bad, max_pixels=10_000)


# ---- v1 ----------------------------------------------------------------------------------------
def test_predict_multipart_matches_the_guard_in_process(client, guard, images) -> None:
    names = [f"img{i}.png" for i in range(len(images))]
    response = client.post(
        "/v1/predict",
        files=[("files", (n, b, "image/png")) for n, b in zip(names, images, strict=True)],
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == {"name": "tiny", "version": "7"}
    assert_matches(body["results"], expected(guard, images), names)


def test_predict_json_base64_matches_the_guard(client, guard, images) -> None:
    payload = {"instances": [{"b64": base64.b64encode(b).decode()} for b in images[:3]]}
    response = client.post("/v1/predict", json=payload)
    assert response.status_code == 200, response.text
    assert_matches(response.json()["results"], expected(guard, images[:3]), [None] * 3)


def test_concurrent_single_image_requests_are_batched_and_correct(
    client, server, guard, images
) -> None:
    reference = expected(guard, images[:5])
    before = server.runtime.metrics.batch_size.collect()[0].samples

    def one(i: int) -> dict:
        r = client.post("/v1/predict", files={"files": ("x.png", images[i % 5], "image/png")})
        assert r.status_code == 200, r.text
        return r.json()["results"][0]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(48)))
    assert [r["label"] for r in results] == [int(reference.labels[i % 5]) for i in range(48)]
    np.testing.assert_allclose(
        [r["score"] for r in results], [reference.scores[i % 5] for i in range(48)], atol=1e-5
    )
    after = server.runtime.metrics.batch_size.collect()[0].samples
    count = {s.name: s.value for s in after}["lapguard_batch_size_count"] - {
        s.name: s.value for s in before
    }["lapguard_batch_size_count"]
    assert count < 48, "concurrent requests should share forward passes"


def test_model_summary_and_health(client, guard) -> None:
    summary = client.get("/v1/model").json()
    assert summary["name"] == "tiny" and summary["version"] == "7"
    assert summary["class_names"] == CLASSES
    assert summary["threshold"] == pytest.approx(guard.threshold)
    assert summary["target_fpr"] == pytest.approx(0.1)
    assert summary["input_spec"]["height"] == 28 and summary["ready"] is True
    assert client.get("/healthz").json() == {"status": "ok", "ready": True}
    assert client.get("/readyz").status_code == 200


def test_request_id_is_echoed_or_generated(client) -> None:
    assert (
        client.get("/healthz", headers={"X-Request-ID": "abc-123"}).headers["x-request-id"]
        == "abc-123"
    )
    generated = client.get("/healthz").headers["x-request-id"]
    assert len(generated) == 32


# ---- v2 (Open Inference Protocol) ----------------------------------------------------------------
def test_v2_metadata_and_health(client) -> None:
    assert client.get("/v2").json()["extensions"] == ["binary_tensor_data"]
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}
    assert client.get("/v2/models/tiny/ready").status_code == 200
    metadata = client.get("/v2/models/tiny").json()
    assert metadata["versions"] == ["7"]
    assert metadata["inputs"][0] == {
        "name": "input",
        "datatype": "FP32",
        "shape": [-1, 1, 28, 28],
        "parameters": {"value_range": [0.0, 1.0], "alternative_to": "image"},
    }
    assert [o["name"] for o in metadata["outputs"]] == [
        "probabilities",
        "label",
        "flagged",
        "score",
    ]


def test_v2_infer_json_fp32(client, guard) -> None:
    x = synthetic_images(3, seed=5)
    request = {
        "id": "r1",
        "inputs": [
            {
                "name": "input",
                "shape": list(x.shape),
                "datatype": "FP32",
                "data": x.reshape(-1).tolist(),
            }
        ],
    }
    response = client.post("/v2/models/tiny/infer", json=request)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model_name"] == "tiny" and body["model_version"] == "7" and body["id"] == "r1"
    outputs = {o["name"]: o for o in body["outputs"]}
    reference = guard.predict(x)
    assert (
        outputs["label"]["datatype"] == "INT64"
        and outputs["label"]["data"] == reference.labels.tolist()
    )
    assert (
        outputs["flagged"]["datatype"] == "BOOL"
        and outputs["flagged"]["data"] == reference.flagged.tolist()
    )
    assert outputs["probabilities"]["shape"] == [3, 10]
    np.testing.assert_allclose(
        np.reshape(outputs["probabilities"]["data"], (3, 10)), reference.probabilities, atol=1e-5
    )
    np.testing.assert_allclose(outputs["score"]["data"], reference.scores, atol=1e-5)


def test_v2_infer_binary_extension_by_hand(client, guard) -> None:
    """Exactly what a v2 client sends: JSON header + raw little-endian tensor bytes."""
    x = synthetic_images(2, seed=6)
    raw = x.astype("<f4").tobytes()
    header = {
        "inputs": [
            {
                "name": "input",
                "shape": [2, 1, 28, 28],
                "datatype": "FP32",
                "parameters": {"binary_data_size": len(raw)},
            }
        ],
        "outputs": [
            {"name": "label", "parameters": {"binary_data": True}},
            {"name": "score", "parameters": {"binary_data": False}},
        ],
    }
    head = json.dumps(header).encode()
    response = client.post(
        "/v2/models/tiny/versions/7/infer",
        content=head + raw,
        headers={
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        },
    )
    assert response.status_code == 200, response.text
    length = int(response.headers["inference-header-content-length"])
    body = json.loads(response.content[:length])
    label, score = body["outputs"]
    assert label["parameters"]["binary_data_size"] == 16 and "data" not in label
    reference = guard.predict(x)
    assert np.frombuffer(response.content[length:], "<i8").tolist() == reference.labels.tolist()
    np.testing.assert_allclose(score["data"], reference.scores, atol=1e-5)


def test_v2_bytes_images_json_and_binary(client, guard, images) -> None:
    reference = expected(guard, images[:2])
    as_json = {
        "inputs": [
            {
                "name": "image",
                "shape": [2],
                "datatype": "BYTES",
                "data": [base64.b64encode(b).decode() for b in images[:2]],
            }
        ]
    }
    response = client.post("/v2/models/tiny/infer", json=as_json)
    assert response.status_code == 200, response.text
    assert {o["name"]: o["data"] for o in response.json()["outputs"]}[
        "label"
    ] == reference.labels.tolist()
    raw = b"".join(struct.pack("<I", len(b)) + b for b in images[:2])
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [2],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ]
        }
    ).encode()
    response = client.post(
        "/v2/models/tiny/infer",
        content=head + raw,
        headers={"Inference-Header-Content-Length": str(len(head))},
    )
    assert response.status_code == 200, response.text
    assert {o["name"]: o["data"] for o in response.json()["outputs"]}[
        "flagged"
    ] == reference.flagged.tolist()


def test_v2_with_the_stock_kserve_triton_client(server, guard, images) -> None:
    httpclient = pytest.importorskip(
        "tritonclient.http", reason="tritonclient[http] is not installed"
    )
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    headers = {"X-API-Key": API_KEY}
    try:
        assert (
            client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
        )
        assert client.get_model_metadata("tiny")["name"] == "tiny"
        x = synthetic_images(4, seed=7)
        for binary in (True, False):
            tensor = httpclient.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            outputs = [
                httpclient.InferRequestedOutput(n, binary_data=binary)
                for n in ("probabilities", "label", "flagged", "score")
            ]
            # a fresh dict per call: the client writes Inference-Header-Content-Length into it
            result = client.infer("tiny", [tensor], outputs=outputs, headers=dict(headers))
            reference = guard.predict(x)
            assert result.as_numpy("label").tolist() == reference.labels.tolist()
            assert result.as_numpy("flagged").tolist() == reference.flagged.tolist()
            np.testing.assert_allclose(
                result.as_numpy("probabilities"), reference.probabilities, atol=1e-5
            )
            np.testing.assert_allclose(result.as_numpy("score"), reference.scores, atol=1e-5)
        encoded = httpclient.InferInput("image", [3], "BYTES")
        encoded.set_data_from_numpy(np.array(images[:3], dtype=np.object_), binary_data=True)
        result = client.infer(
            "tiny", [encoded], headers=dict(headers)
        )  # no outputs named: all, binary
        assert result.as_numpy("label").tolist() == expected(guard, images[:3]).labels.tolist()
        # errors reach the stock client as readable text, as the protocol shapes them
        wrong = httpclient.InferInput("input", [1, 5, 28, 28], "FP32")
        wrong.set_data_from_numpy(np.zeros((1, 5, 28, 28), np.float32), binary_data=True)
        with pytest.raises(httpclient.InferenceServerException) as raised:
            client.infer("tiny", [wrong], headers=dict(headers))
        assert raised.value.status() == "400" and "channel" in raised.value.message()
    finally:
        client.close()


# ---- errors: each answers its code and JSON body, and the server keeps answering ----------------------
def _bomb() -> bytes:
    return encode(np.zeros((3000, 3000), np.uint8))  # 9 Mpx, a few kB compressed, > max_pixels


def _ico() -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (16, 16)).save(buffer, "ICO")
    return buffer.getvalue()


def _v2(shape: list[int], values: int) -> dict:
    return {
        "json": {
            "inputs": [
                {"name": "input", "shape": shape, "datatype": "FP32", "data": [0.5] * values}
            ]
        }
    }


ERROR_CASES = {
    "corrupt image": (
        "/v1/predict",
        lambda im: {"files": {"files": ("a.png", im[0][:80], "image/png")}},
        400,
        "invalid_input",
    ),
    "not an image": (
        "/v1/predict",
        lambda im: {"files": {"files": ("a.bin", b"hello world", "application/octet-stream")}},
        400,
        "invalid_input",
    ),
    "bad base64": (
        "/v1/predict",
        lambda im: {"json": {"instances": [{"b64": "%%%"}]}},
        400,
        "invalid_input",
    ),
    "text part": (
        "/v1/predict",
        lambda im: {"files": {"files": ("a.txt", b"hello", "text/plain")}},
        415,
        "unsupported_media_type",
    ),
    "ico format": (
        "/v1/predict",
        lambda im: {"files": {"files": ("a.ico", _ico(), "image/x-icon")}},
        415,
        "unsupported_media_type",
    ),
    "body type": (
        "/v1/predict",
        lambda im: {"content": b"abc", "headers": {"Content-Type": "text/plain"}},
        415,
        "unsupported_media_type",
    ),
    "too many images": (
        "/v1/predict",
        lambda im: {"files": [("files", ("a.png", im[0], "image/png"))] * 9},
        413,
        "payload_too_large",
    ),
    "too many instances": (
        "/v1/predict",
        lambda im: {"json": {"instances": [{"b64": "AA=="}] * 9}},
        413,
        "payload_too_large",
    ),
    "body too large": (
        "/v1/predict",
        lambda im: {"content": b"x" * 250_000, "headers": {"Content-Type": "application/json"}},
        413,
        "payload_too_large",
    ),
    "chunked body too large": (
        "/v1/predict",
        lambda im: {
            "content": iter([b"x" * 60_000] * 5),
            "headers": {"Content-Type": "application/json"},
        },
        413,
        "payload_too_large",
    ),
    "decompression bomb": (
        "/v1/predict",
        lambda im: {"files": {"files": ("bomb.png", _bomb(), "image/png")}},
        413,
        "payload_too_large",
    ),
    "schema": (
        "/v1/predict",
        lambda im: {"json": {"instances": [{"url": "http://x"}]}},
        422,
        "validation_error",
    ),
    "invalid json": (
        "/v1/predict",
        lambda im: {"content": b"{", "headers": {"Content-Type": "application/json"}},
        422,
        "validation_error",
    ),
    "no files field": (
        "/v1/predict",
        lambda im: {"data": {"x": "1"}, "files": {"other": ("a.png", im[0], "image/png")}},
        422,
        "validation_error",
    ),
    "wrong tensor rank": (
        "/v2/models/tiny/infer",
        lambda im: _v2([2, 28, 28], 2 * 784),
        400,
        "invalid_input",
    ),
    "wrong tensor channels": (
        "/v2/models/tiny/infer",
        lambda im: _v2([1, 5, 28, 28], 5 * 784),
        400,
        "invalid_input",
    ),
    "shape and data disagree": (
        "/v2/models/tiny/infer",
        lambda im: _v2([1, 1, 28, 28], 700),
        400,
        "invalid_input",
    ),
    "too many tensor images": (
        "/v2/models/tiny/infer",
        lambda im: _v2([9, 1, 2, 2], 36),
        413,
        "payload_too_large",
    ),
    "v2 schema": (
        "/v2/models/tiny/infer",
        lambda im: {"json": {"inputs": [{"name": "input"}]}},
        422,
        "validation_error",
    ),
    "unknown model": (
        "/v2/models/other/infer",
        lambda im: _v2([1, 1, 28, 28], 784),
        404,
        "model_not_found",
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_answers_its_code_and_the_server_keeps_answering(client, images, case: str) -> None:
    path, request, status, code = ERROR_CASES[case]
    response = client.post(path, **request(images))
    assert response.status_code == status, response.text
    assert error_code(response) == code and error_message(response)
    assert response.headers["x-request-id"]
    after = client.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")})
    assert after.status_code == 200 and client.get("/readyz").status_code == 200


def test_api_key_is_required_on_inference_routes_only(server, images) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for headers in (
            {},
            {"X-API-Key": "wrong"},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic abc"},
        ):
            response = anonymous.post(
                "/v1/predict", files={"files": ("a.png", images[0], "image/png")}, headers=headers
            )
            assert (
                response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"
            )
            assert client_error_has_www_authenticate(response)
        refused = anonymous.post("/v2/models/tiny/infer", **_v2([1, 1, 28, 28], 784))
        assert refused.status_code == 401 and error_code(refused) == "unauthorized"
        ok = anonymous.post(
            "/v1/predict",
            files={"files": ("a.png", images[0], "image/png")},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        assert ok.status_code == 200
        assert (
            anonymous.get("/readyz").status_code == 200
            and anonymous.get("/metrics").status_code == 200
        )


def error_code(response: httpx.Response) -> str:
    """The error code of an error answer: DESIGN's ``{"error": {"code", "message"}}``, or under
    /v2 the Open Inference Protocol's ``{"error": "message", "code": ...}``."""
    body = response.json()
    if response.url.path.startswith("/v2"):
        assert isinstance(body["error"], str), body
        return body["code"]
    return body["error"]["code"]


def error_message(response: httpx.Response) -> str:
    error = response.json()["error"]
    return error if response.url.path.startswith("/v2") else error["message"]


def client_error_has_www_authenticate(response: httpx.Response) -> bool:
    return response.headers.get("www-authenticate", "").startswith("Bearer")


def test_unknown_route_and_method_use_the_error_shape(client) -> None:
    missing = client.get("/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = client.get("/v1/predict")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def test_not_ready_or_draining_answers_503_with_retry_after(client, server, images) -> None:
    server.runtime.draining = True
    try:
        for response in (
            client.get("/readyz"),
            client.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")}),
        ):
            assert response.status_code == 503 and response.json()["error"]["code"] == "not_ready"
            assert int(response.headers["retry-after"]) >= 1
        assert client.get("/healthz").json()["status"] == "draining"
    finally:
        server.runtime.draining = False
    assert client.get("/readyz").status_code == 200


def test_metrics_are_exposed(client, images) -> None:
    client.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")})
    text = client.get("/metrics").text
    assert 'lapguard_http_requests_total{method="POST",route="/v1/predict",status="200"}' in text
    assert (
        'lapguard_http_request_duration_seconds_bucket{le="0.005",method="POST",route="/v1/predict",status="200"}'
        in text
    )
    assert 'route="/v2/models/{name}/infer"' in text
    for name in (
        "lapguard_batch_size_bucket",
        "lapguard_queue_wait_seconds_bucket",
        "lapguard_score_bucket",
        "lapguard_images_total",
        "lapguard_flagged_total",
        "lapguard_ready 1.0",
    ):
        assert name in text


# ---- overload and shutdown ------------------------------------------------------------------------
def test_full_queue_answers_429_and_shutdown_finishes_in_flight_requests(
    service_bundle, guard, images
) -> None:
    """A long max_wait keeps the first request's 4 images queued (the queue holds 4): the next
    request is refused with 429; on SIGTERM a request still waiting for its batch is answered."""
    settings = Settings(
        bundle=service_bundle,
        max_batch_size=64,
        max_wait_ms=1000,
        max_queue=4,
        max_images_per_request=4,
        warmup=False,
    )
    four = [("files", (f"{i}.png", images[i], "image/png")) for i in range(4)]
    with (
        LiveServer(settings, guard=guard) as live,
        httpx.Client(base_url=live.url, timeout=30) as c,
        ThreadPoolExecutor(2) as pool,
    ):
        first = pool.submit(c.post, "/v1/predict", files=four)
        time.sleep(0.3)
        refused = c.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded"
        assert int(refused.headers["retry-after"]) >= 1
        assert first.result(timeout=30).status_code == 200
        assert "lapguard_rejected_total" in c.get("/metrics").text

        in_flight = pool.submit(c.post, "/v1/predict", files=four)
        time.sleep(0.3)
        live.server.handle_exit(signal.SIGTERM, None)
        response = in_flight.result(timeout=30)
        assert response.status_code == 200 and len(response.json()["results"]) == 4
        live.thread.join(timeout=30)
        assert not live.thread.is_alive()


class SlowGuard:
    """The real Guard with a slow forward (sleeps in the worker thread)."""

    def __init__(self, guard, seconds: float) -> None:
        self._guard, self._seconds = guard, seconds

    def __getattr__(self, name: str):
        return getattr(self._guard, name)

    def predict(self, x):
        time.sleep(self._seconds)
        return self._guard.predict(x)


class HeldWarmup(SlowGuard):
    """The real Guard whose warm-up lasts until the test releases it (no race with the clock)."""

    def __init__(self, guard) -> None:
        super().__init__(guard, 0.0)
        self.release = threading.Event()

    def warmup(self, batch_sizes=(1, 8)) -> None:
        self.release.wait(timeout=60)


def test_not_ready_until_warmed_up(service_bundle, guard, images) -> None:
    settings = Settings(bundle=service_bundle)
    held = HeldWarmup(guard)
    with (
        LiveServer(settings, guard=held, wait_for="/healthz") as live,
        httpx.Client(base_url=live.url, timeout=30) as c,
    ):
        assert c.get("/healthz").json() == {"status": "ok", "ready": False}
        for response in (
            c.get("/readyz"),
            c.get("/v2/health/ready"),
            c.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")}),
        ):
            assert response.status_code == 503 and error_code(response) == "not_ready"
            assert int(response.headers["retry-after"]) >= 1
        held.release.set()
        deadline = time.monotonic() + 30
        while c.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (
            c.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")}).status_code
            == 200
        )


def test_health_and_metrics_answer_while_the_model_computes(service_bundle, guard, images) -> None:
    settings = Settings(bundle=service_bundle, max_wait_ms=1, warmup=False)
    with (
        LiveServer(settings, guard=SlowGuard(guard, 3.0)) as live,
        httpx.Client(base_url=live.url, timeout=30) as c,
        ThreadPoolExecutor(1) as pool,
    ):
        busy = pool.submit(
            c.post, "/v1/predict", files={"files": ("a.png", images[0], "image/png")}
        )
        time.sleep(0.3)
        for path in ("/healthz", "/metrics"):
            start = time.perf_counter()
            assert c.get(path).status_code == 200
            assert time.perf_counter() - start < 1.0, f"{path} waited for the forward pass"
        assert not busy.done()  # the forward pass (3 s) was still running
        assert busy.result(timeout=30).status_code == 200


# ---- the command line -------------------------------------------------------------------------------
def _serve(bundle: Path, *extra: str) -> subprocess.Popen:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("LAPGUARD_") or k == "LAPGUARD_DATA"
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "training.cli",
            "serve",
            "--bundle",
            str(bundle),
            "--device",
            "cpu",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_tampered_bundle_stops_start_up_naming_the_file(service_bundle, tmp_path) -> None:
    tampered = tmp_path / "bundle"
    shutil.copytree(service_bundle, tampered)
    data = bytearray((tampered / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tampered / "model.safetensors").write_bytes(bytes(data))
    process = _serve(tampered, "--port", "0")
    try:
        _, stderr = process.communicate(timeout=90)
    finally:
        process.kill()
    assert process.returncode != 0
    last = stderr.strip().splitlines()[-1]
    assert (
        last.startswith("lapguard serve: error:")
        and "model.safetensors" in last
        and "checksum" in last
    )


def test_serve_command_logs_json_with_request_ids_and_stops_on_sigterm(
    service_bundle, images
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = _serve(
        service_bundle, "--port", str(port), "--max-batch-size", "4", "--max-wait-ms", "1"
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        response = httpx.post(
            url + "/v1/predict",
            files={"files": ("a.png", images[0], "image/png")},
            headers={"X-Request-ID": "cli-req-1"},
        )
        assert response.status_code == 200, response.text
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode in (0, -signal.SIGTERM)
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    request = [r for r in records if r.get("request_id") == "cli-req-1"]
    assert request and request[0]["route"] == "/v1/predict" and request[0]["status"] == 200
    assert request[0]["duration_ms"] > 0 and request[0]["level"] == "info"
    assert any(r["message"] == "ready" for r in records)
