"""The input spec's resize policy: an upload of another size becomes the network's input as
torchvision's eval transform makes it (shorter side, then the centre), a spec without the policy
stretches and reads, writes and converts exactly as before, and an inconsistent policy is refused
in one line when a config or bundle loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF

from detector.bundle import read_manifest
from detector.errors import ArtefactError, InputError
from detector.networks import InputSpec, NetworkConfig, read_config
from detector.preprocessing import prepare_images, scale_uint8
from tests.service_helpers import rewrite_bundle

RGB = {"channels": 3, "mean": [0.5] * 3, "std": [0.25] * 3}
CROPPED = InputSpec(height=224, width=224, resize_to=256, crop="center", **RGB)


def _disc_on_bands(height: int = 375, width: int = 500) -> np.ndarray:
    """uint8 HWC: a black disc (radius 100) centred on mid grey, inside white bands (60 columns
    left and right, 15 rows top and bottom) that a centre crop to 224 of 256 cuts off."""
    rows, cols = np.mgrid[:height, :width]
    image = np.full((height, width), 128, np.uint8)
    image[(rows - (height - 1) / 2) ** 2 + (cols - (width - 1) / 2) ** 2 <= 100**2] = 0
    image[:, :60] = image[:, -60:] = 255
    image[:15] = image[-15:] = 255
    return np.repeat(image[..., None], 3, axis=2)


def _extent(mask: np.ndarray, axis: int) -> int:
    """How many columns (axis 0: the width) or rows (axis 1: the height) of ``mask`` hold a True."""
    return int(mask.any(axis=axis).sum())


def test_a_photo_is_resized_by_its_shorter_side_and_cropped_at_the_centre() -> None:
    image = _disc_on_bands()
    x = prepare_images([image], CROPPED)[0]
    assert x.shape == (3, 224, 224)
    assert x.max() < 0.6  # the white bands are cut off: only grey and the disc remain
    disc = (x[0] < 0.25).numpy()
    assert abs(_extent(disc, 0) - _extent(disc, 1)) <= 1  # still round: the aspect is kept
    assert _extent(disc, 0) == pytest.approx(200 * 256 / 375, abs=2)
    reference = TF.center_crop(
        TF.resize(torch.from_numpy(image).permute(2, 0, 1).float() / 255, [256], antialias=True),
        [224, 224],
    )
    torch.testing.assert_close(x, reference.clamp(0, 1), atol=1e-5, rtol=0)


def test_a_non_square_network_takes_a_non_square_centre() -> None:
    spec = InputSpec(height=200, width=160, resize_to=240, crop="center", **RGB)
    image = np.random.default_rng(0).integers(0, 256, (375, 500, 3), dtype=np.uint8)
    x = prepare_images([image], spec)[0]
    chw = torch.from_numpy(image).permute(2, 0, 1).float() / 255
    reference = TF.center_crop(TF.resize(chw, [240], antialias=True), [200, 160])
    torch.testing.assert_close(x, reference.clamp(0, 1), atol=1e-5, rtol=0)


def test_without_a_crop_the_image_is_stretched_as_before() -> None:
    """The conversion of every network without a policy, bit for bit: a bilinear antialiased
    stretch of the whole image (the disc becomes an ellipse and the bands stay)."""
    spec = InputSpec(height=224, width=224, **RGB)
    image = _disc_on_bands()
    x = prepare_images([image], spec)[0]
    chw = torch.from_numpy(image).permute(2, 0, 1).float() / 255
    before = F.interpolate(
        chw[None], size=(224, 224), mode="bilinear", antialias=True, align_corners=False
    )[0].clamp(0, 1)
    assert torch.equal(x, before)
    disc = (x[0] < 0.25).numpy()
    assert _extent(disc, 0) + 20 < _extent(disc, 1) and x.max() > 0.99  # narrower than tall


def test_images_of_the_network_size_are_taken_as_they_are_and_channels_converted() -> None:
    rng = np.random.default_rng(1)
    stack = rng.integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)
    assert torch.equal(prepare_images(stack, CROPPED), prepare_images(list(stack), CROPPED))
    as_is = scale_uint8(stack[0].transpose(2, 0, 1), (0.0, 1.0))
    assert torch.equal(prepare_images(stack, CROPPED)[0], as_is)
    grey = rng.integers(0, 256, (300, 400), dtype=np.uint8)
    x = prepare_images([grey], CROPPED)[0]
    assert x.shape == (3, 224, 224) and torch.equal(x[0], x[2])
    rgba = np.dstack([_disc_on_bands(), np.full((375, 500), 9, np.uint8)])
    assert torch.equal(prepare_images([rgba], CROPPED), prepare_images([_disc_on_bands()], CROPPED))


def test_a_strict_spec_still_refuses_other_sizes() -> None:
    spec = InputSpec(height=224, width=224, resize="strict", **RGB)
    with pytest.raises(InputError, match="takes exactly 3x224x224 and its input spec is strict"):
        prepare_images([_disc_on_bands()], spec)


# ---- validation -------------------------------------------------------------------------------
BAD = [
    ({"resize_to": 200, "crop": "center"}, "resize_to 200 is smaller than the 224x224 crop"),
    ({"resize_to": 256}, "resize_to and crop go together"),
    ({"crop": "center"}, "resize_to and crop go together"),
    ({"resize": "strict", "resize_to": 256, "crop": "center"}, "a strict input spec resizes nothing: drop resize_to, crop"),
    ({"resize": "strict", "interpolation": "bicubic"}, "a strict input spec resizes nothing: drop interpolation"),
    ({"crop": "top", "resize_to": 256}, "Input should be 'center'"),
    ({"interpolation": "nearest"}, "Input should be 'bilinear' or 'bicubic'"),
    ({"resize_to": 0, "crop": "center"}, "greater than or equal to 1"),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "needle"), BAD)
def test_an_inconsistent_policy_is_refused(policy: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        InputSpec(height=224, width=224, **RGB, **policy)


def test_a_config_or_bundle_with_an_inconsistent_policy_is_refused_in_one_line(
    service_bundle: Path, tmp_path: Path
) -> None:
    manifest = json.loads((service_bundle / "manifest.json").read_text())
    spec = {**manifest["input_spec"], "resize_to": 20, "crop": "center"}
    bundle = rewrite_bundle(service_bundle, tmp_path / "bundle", input_spec=spec)
    with pytest.raises(ArtefactError) as refused:
        read_manifest(bundle)
    assert "\n" not in str(refused.value)
    assert "resize_to 20 is smaller than the 28x28 crop" in str(refused.value)
    network = tmp_path / "network"
    network.mkdir()
    config = {**manifest["network"], "input_spec": {**spec, "resize": "strict", "resize_to": 30}}
    (network / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtefactError) as refused:
        read_config(network)
    assert "\n" not in str(refused.value)
    assert "input_spec: Value error, a strict input spec resizes nothing" in str(refused.value)


# ---- existing artefacts read and write as before ----------------------------------------------
OLD_CONFIG = (
    '{"format_version":1,"architecture":"resnet9_mnist","arguments":{"width":4},'
    '"class_names":["a","b"],"input_spec":{"channels":1,"height":28,"width":28,'
    '"value_range":[0.0,1.0],"mean":[0.286],"std":[0.353],"resize":"convert"}}'
)


def test_a_config_without_the_policy_round_trips_byte_for_byte(service_bundle: Path) -> None:
    assert NetworkConfig.model_validate_json(OLD_CONFIG).model_dump_json() == OLD_CONFIG
    text = (service_bundle / "manifest.json").read_text()
    assert read_manifest(service_bundle).model_dump_json(indent=2) == text
    assert set(json.loads(text)["input_spec"]) == {
        "channels", "height", "width", "value_range", "mean", "std", "resize",
    }  # fmt: skip


def test_a_config_with_the_policy_round_trips_with_it() -> None:
    policy = '"resize_to":32,"crop":"center","interpolation":"bicubic"'
    text = OLD_CONFIG.replace('"resize":"convert"', f'"resize":"convert",{policy}')
    config = NetworkConfig.model_validate_json(text)
    assert config.model_dump_json() == text
    assert config.input_spec.resize_to == 32 and config.input_spec.crop == "center"
    again = NetworkConfig.model_validate_json(config.model_dump_json())
    assert again == config and again.model_dump_json() == config.model_dump_json()
    assert config.input_spec.describe_resize() == (
        "shorter side to 32 then centre crop 28x28 (antialiased bicubic)"
    )


def test_a_reload_keeps_the_served_resize_policy() -> None:
    """Queued uploads were converted by the served policy: a bundle with another is refused."""
    from types import SimpleNamespace

    from service.reload import check_compatible

    served = SimpleNamespace(input_spec=CROPPED)
    stretch = SimpleNamespace(input_spec=InputSpec(height=224, width=224, **RGB))
    with pytest.raises(ArtefactError, match="resize_to 256 -> None, crop center -> None"):
        check_compatible(served, stretch)
    check_compatible(served, SimpleNamespace(input_spec=CROPPED.model_copy()))
