"""Images as users send them, against a live server: a 500x375 JPEG reaches an imported
3x224x224 network through its resize policy (shorter side to 256, centre 224) with the Guard's
scores, and an RGB PNG reaches the grey tiny bundle converted by luma."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from torchvision.models.vision_transformer import VisionTransformer
from torchvision.transforms.v2 import functional as TF

from detector.guard import Guard
from detector.images import decode_image
from service.settings import Settings
from tests.live_server import LiveServer
from tests.service_helpers import API_KEY, assert_matches, encode, expected, noise_bundle
from training.cli.main import main

# A ViT small enough to run at 224x224 in milliseconds: 49 patches of 32, one block of width 16.
VIT = {"image_size": 224, "patch_size": 32, "num_layers": 1, "num_heads": 2, "hidden_dim": 16}
VIT_ARGS = [f"--arg={k}={v}" for k, v in {**VIT, "mlp_dim": 32}.items()]


def _photo(height: int = 375, width: int = 500, seed: int = 0) -> np.ndarray:
    """A smooth seeded RGB "photo", uint8 HxWx3 (small as JPEG and PNG)."""
    coarse = torch.from_numpy(np.random.default_rng(seed).random((1, 3, 6, 8), dtype=np.float32))
    smooth = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear")
    return (smooth[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


def _imported_bundle(tmp: Path) -> Path:
    """The ViT imported with torchvision's eval resize (the default) and a small transport forest
    on its features of clean and noised 224x224 images."""
    torch.manual_seed(0)
    model = VisionTransformer(**VIT, mlp_dim=32, num_classes=3).eval()
    torch.save(model.state_dict(), tmp / "weights.pt")
    command = ["import", "torchvision:VisionTransformer", "--weights", str(tmp / "weights.pt")]
    assert main([*command, "--out", str(tmp / "net"), *VIT_ARGS]) == 0
    shape = (24, 3, 224, 224)
    return noise_bundle(
        tmp / "net", tmp / "bundle", shape, min_class_samples=5, name="imported-vit"
    )[0]


@pytest.fixture(scope="module")
def imported_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _imported_bundle(tmp_path_factory.mktemp("imported"))


@pytest.fixture(scope="module")
def imported_server(imported_bundle: Path) -> Iterator[LiveServer]:
    settings = Settings(bundle=imported_bundle, device="cpu", api_key=API_KEY, max_wait_ms=2)
    with LiveServer(settings) as live:
        yield live


def _predict(url: str, blob: bytes, name: str, media: str) -> httpx.Response:
    files = [("files", (name, blob, media))]
    return httpx.post(f"{url}/v1/predict", files=files, headers={"X-API-Key": API_KEY}, timeout=60)


def test_a_photo_reaches_an_imported_network_through_its_resize_policy(
    imported_bundle: Path, imported_server: LiveServer
) -> None:
    guard = Guard.from_bundle(imported_bundle, device="cpu")
    spec = guard.input_spec
    assert (spec.shape, spec.resize_to, spec.crop) == ((3, 224, 224), 256, "center")
    assert imported_server.runtime.input_spec == spec
    blob = encode(_photo(), "JPEG")
    response = _predict(imported_server.url, blob, "photo.jpg", "image/jpeg")
    assert response.status_code == 200, response.text
    [served] = response.json()["results"]
    reference = expected(guard, [blob])
    assert served["label"] == int(reference.labels[0])
    assert served["score"] == pytest.approx(float(reference.scores[0]), abs=1e-5)
    assert served["confidence"] == pytest.approx(float(reference.confidences[0]), abs=1e-5)
    # the Guard's input is torchvision's Resize(256) + CenterCrop(224) of the decoded photo
    decoded = decode_image(blob)
    pixels = torch.from_numpy(np.array(decoded)).permute(2, 0, 1).float() / 255
    cropped = TF.center_crop(TF.resize(pixels, [256], antialias=True), [224, 224]).clamp(0, 1)
    torch.testing.assert_close(guard.prepare([decoded])[0], cropped, atol=1e-5, rtol=0)
    by_hand = guard.predict(cropped[None])
    assert served["score"] == pytest.approx(float(by_hand.scores[0]), abs=1e-4)


def test_an_rgb_png_reaches_the_grey_bundle_converted_by_luma(client: httpx.Client, guard) -> None:
    blob = encode(_photo(seed=1))
    response = client.post("/v1/predict", files=[("files", ("photo.png", blob, "image/png"))])
    assert response.status_code == 200, response.text
    assert_matches(response.json()["results"], expected(guard, [blob]), ["photo.png"])
