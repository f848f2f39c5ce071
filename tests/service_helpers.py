"""What the service tests share besides fixtures: the tiny real bundle, seeded images, the
reference answers of the in-process Guard, and readers of the two error shapes."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from detector.images import decode_image
from detector.networks import InputSpec, NetworkConfig, build_network, save
from service.settings import Settings

API_KEY = "test-key-123"
ADMIN_KEY = "admin-key-456"
CLASSES = [f"class_{i}" for i in range(10)]
LIMITS = {"max_body_bytes": 200_000, "max_images_per_request": 8, "max_pixels": 512 * 512}
PREDICTION_KEYS = {
    "index",
    "filename",
    "label",
    "class_name",
    "confidence",
    "flagged",
    "score",
    "threshold",
    "query_attack",
}


# ---- data ---------------------------------------------------------------------------------------
def server_settings(bundle: Path, **overrides: Any) -> Settings:
    """The settings of the service tests' server on ``bundle``: CPU, the API key, batches of up
    to 8 within 2 ms and the small :data:`LIMITS`; ``overrides`` replace any of them."""
    fields: dict[str, Any] = {"device": "cpu", "api_key": API_KEY, "max_batch_size": 8}
    return Settings(bundle=bundle, **{**fields, "max_wait_ms": 2, **LIMITS, **overrides})


def synthetic_images(n: int, seed: int) -> np.ndarray:
    """Smooth seeded blobs, float32 [n, 1, 28, 28] in [0, 1]."""
    rng = np.random.default_rng(seed)
    coarse = torch.from_numpy(rng.random((n, 1, 7, 7), dtype=np.float32))
    return torch.nn.functional.interpolate(coarse, size=(28, 28), mode="bilinear").numpy()


def near_duplicates(image: np.ndarray, n: int, sigma: float, seed: int) -> np.ndarray:
    """``n`` copies of ``image`` with Gaussian noise, clipped to [0, 1] (HopSkipJump-like probes)."""
    rng = np.random.default_rng(seed)
    noisy = image[None] + rng.normal(0, sigma, (n, *image.shape))
    return np.clip(noisy, 0, 1).astype(np.float32)


def encode(array: np.ndarray, fmt: str = "PNG") -> bytes:
    """``array`` as an encoded image file (PNG unless ``fmt`` says otherwise)."""
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, fmt)
    return buffer.getvalue()


def decompression_bomb() -> bytes:
    """A 9 Mpx PNG of a few kB, over the services' ``max_pixels``."""
    return encode(np.zeros((3000, 3000), np.uint8))


def ico_image() -> bytes:
    """A valid image in a format the service does not accept (ICO)."""
    buffer = io.BytesIO()
    Image.new("L", (16, 16)).save(buffer, "ICO")
    return buffer.getvalue()


def v2_request(shape: list[int], values: int) -> dict:
    """httpx keyword arguments of a v2 JSON infer request: one FP32 'input' of ``values`` 0.5s."""
    return {
        "json": {
            "inputs": [
                {"name": "input", "shape": shape, "datatype": "FP32", "data": [0.5] * values}
            ]
        }
    }


#: The routes that score encoded images, and the model the conftest server serves.
INFERENCE_PATHS = ("/v1/predict", "/v1/explain", "/v2/models/tiny/infer")


def upload(path: str, blobs: list[bytes]) -> dict:
    """httpx keyword arguments sending encoded images to ``path``: multipart ``files`` under
    /v1, a BYTES input of base64 strings under /v2."""
    if not path.startswith("/v2"):
        return {
            "files": [("files", (f"{i}.png", blob, "image/png")) for i, blob in enumerate(blobs)]
        }
    data = [base64.b64encode(blob).decode() for blob in blobs]
    tensor = {"name": "image", "shape": [len(blobs)], "datatype": "BYTES", "data": data}
    return {"json": {"inputs": [tensor]}}


def many_parts(count: int, *, files: bool) -> dict:
    """httpx keyword arguments of a multipart body of ``count`` empty parts, files or text
    fields, ~70 bytes each: thousands fit under the conftest server's body limit."""
    disposition = 'name="files"; filename="a.png"' if files else 'name="field"'
    part = f"--b\r\nContent-Disposition: form-data; {disposition}\r\n\r\n\r\n".encode()
    headers = {"Content-Type": "multipart/form-data; boundary=b"}
    return {"content": part * count + b"--b--\r\n", "headers": headers}


# ---- the tiny real bundle -----------------------------------------------------------------------
STRICT_TARGET_FPR = 0.05  # the tiny bundle's second operating point (its own is 0.1)


def build_service_bundle(tmp: Path) -> Path:
    """network (2 blocks, seeded) + transport forest fitted on clean vs noised images + threshold
    (and a stricter operating point at target FPR 0.05), written as a bundle under ``tmp``."""
    from detector.bundle import write_bundle
    from detector.calibration import Calibration, calibrate_threshold, empirical_fpr
    from detector.features import extract_features
    from detector.forest import TransportDetector
    from detector.networks import load

    config = NetworkConfig(
        architecture="resnet9_mnist",
        arguments={"width": 4, "depth": 2, "hidden": 8},
        class_names=CLASSES,
        input_spec=InputSpec(channels=1, height=28, width=28, mean=[0.2860], std=[0.3530]),
    )
    torch.manual_seed(0)
    save(build_network(config).eval(), tmp / "network", config)
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
    strict = calibrate_threshold(scores, STRICT_TARGET_FPR)
    return write_bundle(
        tmp / "bundle",
        network_dir=tmp / "network",
        detector=detector,
        calibration=calibration,
        name="tiny",
        version="7",
        dataset="synthetic",
        metrics={"test_accuracy": 0.1},
        operating_points=[
            calibration,
            Calibration(
                threshold=strict,
                target_fpr=STRICT_TARGET_FPR,
                achieved_fpr=empirical_fpr(scores, strict),
                n=len(scores),
            ),
        ],
    )


def noise_bundle(
    network_dir: Path, out: Path, shape: tuple[int, ...], *, min_class_samples: int, name: str
) -> tuple[Path, np.ndarray]:
    """A bundle of the network in ``network_dir``: a small transport forest fitted on its features
    of seeded random images of ``shape`` (clean) and their noised copies (abnormal), threshold
    at 10% FPR on the clean ones. Returns the bundle and the clean images."""
    from detector.bundle import write_bundle
    from detector.calibration import Calibration, calibrate_threshold
    from detector.features import extract_features
    from detector.forest import TransportDetector
    from detector.networks import load

    network = load(network_dir)
    rng = np.random.default_rng(0)
    clean = rng.random(shape, dtype=np.float32)
    noisy = np.clip(clean + rng.normal(0, 0.3, clean.shape), 0, 1).astype(np.float32)
    (f_clean, l_clean), (f_noisy, l_noisy) = (extract_features(network, x) for x in (clean, noisy))
    n = len(clean)
    detector = TransportDetector(
        n_estimators=5, max_depth=3, min_class_samples=min_class_samples
    ).fit(
        np.concatenate([f_clean, f_noisy]),
        np.repeat([False, True], n),
        np.concatenate([l_clean.argmax(1), l_noisy.argmax(1)]),
    )
    threshold = calibrate_threshold(detector.score(f_clean, l_clean.argmax(1)), 0.1)
    bundle = write_bundle(
        out,
        network_dir=network_dir,
        detector=detector,
        calibration=Calibration(threshold=threshold, target_fpr=0.1, achieved_fpr=0.1, n=n),
        name=name,
        dataset="random",
    )
    return bundle, clean


def rewrite_bundle(source: Path, target: Path, **fields: Any) -> Path:
    """A copy of bundle ``source`` at ``target`` with top-level manifest ``fields`` replaced (e.g.
    another version and threshold; the operating points go unless given, since another threshold
    would contradict them); still valid: the manifest lists the other files' checksums."""
    shutil.copytree(source, target)
    manifest = target / "manifest.json"
    data = json.loads(manifest.read_text())
    data.update({"operating_points": [], **fields})
    manifest.write_text(json.dumps(data, indent=2))
    return target


def flip_last_byte(path: Path) -> None:
    """Tamper with a file: its sha256 no longer matches the manifest's."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# ---- reference answers --------------------------------------------------------------------------
def expected(guard, blobs: list[bytes]):
    """The in-process Guard's predictions for encoded images, decoded as the service does."""
    return guard.predict_images([decode_image(b, max_pixels=LIMITS["max_pixels"]) for b in blobs])


def assert_matches(
    results: list[dict], reference, filenames: list[str | None] | None = None
) -> None:
    """The v1 ``results`` equal the in-process ``reference``, field by field."""
    assert [r["index"] for r in results] == list(range(len(results)))
    assert [r["label"] for r in results] == reference.labels.tolist()
    assert [r["class_name"] for r in results] == [CLASSES[i] for i in reference.labels]
    assert [r["flagged"] for r in results] == reference.flagged.tolist()
    np.testing.assert_allclose([r["confidence"] for r in results], reference.confidences, atol=1e-5)
    np.testing.assert_allclose([r["score"] for r in results], reference.scores, atol=1e-5)
    assert all(r["threshold"] == pytest.approx(reference.threshold) for r in results)
    if filenames is not None:
        assert [r["filename"] for r in results] == filenames
    assert all(set(r) == PREDICTION_KEYS for r in results)


# ---- error answers ------------------------------------------------------------------------------
def error_code(response: httpx.Response) -> str:
    """The error code of an error answer: DESIGN's ``{"error": {"code", "message"}}``, or under
    /v2 the Open Inference Protocol's ``{"error": "message", "code": ...}``."""
    body = response.json()
    if response.url.path.startswith("/v2"):
        assert isinstance(body["error"], str), body
        return body["code"]
    return body["error"]["code"]


def error_message(response: httpx.Response) -> str:
    """The human-readable message of an error answer, in either shape."""
    error = response.json()["error"]
    return error if response.url.path.startswith("/v2") else error["message"]


def client_error_has_www_authenticate(response: httpx.Response) -> bool:
    return response.headers.get("www-authenticate", "").startswith("Bearer")


def square_like(image: np.ndarray, n: int, eps: float, seed: int) -> np.ndarray:
    """``n`` distinct queries of a Square-like L-infinity attack on ``image`` [1, H, W]: vertical
    stripes of +-eps, then each query paints one random square (shrinking from 80% of the image)
    at +-eps around ``image``, kept or dropped at random as the attack's loss would: every query
    lies in the eps-ball of ``image`` (clipped to [0, 1]), yet early ones differ by large squares."""
    rng = np.random.default_rng(seed)
    _, height, width = image.shape
    current = np.clip(image + eps * rng.choice([-1.0, 1.0], size=(1, 1, width)), 0, 1)
    queries = [image, current]
    while len(queries) < n:
        side = max(1, round(np.sqrt(0.8 * 0.5 ** (len(queries) // 10) * height * width)))
        top, left = rng.integers(0, height - side + 1), rng.integers(0, width - side + 1)
        candidate = current.copy()
        window = (slice(None), slice(top, top + side), slice(left, left + side))
        candidate[window] = image[window] + eps * rng.choice([-1.0, 1.0])
        candidate = np.clip(candidate, 0, 1)
        if any(np.array_equal(candidate, query) for query in queries):
            continue  # a square on clipped background can change nothing: not a new query
        queries.append(candidate)
        if rng.random() < 0.5:
            current = candidate
    return np.stack(queries).astype(np.float32)
