"""Bundles (round trip, refusals) and the Guard (input preparation, the one scoring path)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from detector import networks
from detector.bundle import (
    DETECTOR_FILE,
    MANIFEST_FILE,
    SECOND_WEIGHTS_FILE,
    load_bundle,
    write_bundle,
)
from detector.calibration import Calibration
from detector.errors import ArtefactError, ConfigError, InputError
from detector.features import FeatureSpec, extract_features
from detector.forest import TransportDetector
from detector.guard import Guard
from detector.images import decode_image
from detector.preprocessing import prepare_images, quantize_uint8, scale_uint8
from detector.quantile import QuantileDetector
from tests.service_helpers import encode


def _images(n: int, seed: int, noisy: bool) -> np.ndarray:
    """Smooth blobs (clean) or the same plus strong pixel noise (abnormal), in [0, 1]."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:28, 0:28] / 27.0
    centers = rng.random((n, 2))
    images = np.exp(-((xx - centers[:, :1, None]) ** 2 + (yy - centers[:, 1:, None]) ** 2) * 8)
    if noisy:
        images = images + rng.normal(0, 0.35, images.shape)
    return np.clip(images, 0, 1).astype(np.float32)[:, None]


@pytest.fixture
def run(tmp_path: Path, tiny_network: torch.nn.Module) -> dict:
    network_dir = networks.save(tiny_network, tmp_path / "network")
    x = np.concatenate([_images(60, 0, False), _images(60, 1, True)])
    y = np.r_[np.zeros(60), np.ones(60)].astype(int)
    features, logits = extract_features(tiny_network, x)
    detector = TransportDetector(n_estimators=15, min_class_samples=5).fit(
        features, y, logits.argmax(1)
    )
    clean_val, _ = extract_features(tiny_network, _images(50, 2, False))
    clean_scores = detector.score(clean_val, np.zeros(50, int))
    calibration = Calibration.from_scores(clean_scores, 0.1)
    return {
        "network_dir": network_dir,
        "detector": detector,
        "calibration": calibration,
        "clean_scores": clean_scores,
        "model": tiny_network,
    }


@pytest.fixture
def bundle_dir(tmp_path: Path, run: dict) -> Path:
    return write_bundle(
        tmp_path / "bundle",
        network_dir=run["network_dir"],
        detector=run["detector"],
        calibration=run["calibration"],
        name="tiny",
        dataset="fashion-mnist",
        metrics={"accuracy": 0.9},
    )


def test_bundle_round_trip(bundle_dir: Path, run: dict) -> None:
    assert sorted(p.name for p in bundle_dir.iterdir()) == [
        DETECTOR_FILE,
        MANIFEST_FILE,
        networks.WEIGHTS_FILE,
    ]
    bundle = load_bundle(bundle_dir)
    manifest = bundle.manifest
    assert manifest.threshold == run["calibration"].threshold and manifest.target_fpr == 0.1
    assert manifest.detector.kind == "transport" and manifest.detector.feature_names[:2] == [
        "msq_0",
        "cos_0",
    ]
    assert (
        manifest.metrics == {"accuracy": 0.9} and manifest.network.architecture == "resnet9_mnist"
    )
    x = _images(20, 3, True)
    features, logits = extract_features(bundle.model, x)
    predicted = logits.argmax(1)
    np.testing.assert_allclose(
        bundle.detector.score(features, predicted),
        run["detector"].score(features, predicted),
        atol=1e-6,
    )
    for a, b in zip(
        bundle.model.state_dict().values(), run["model"].state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)


def _bundle_with_points(out: Path, run: dict, targets: tuple[float, ...]) -> Path:
    points = [Calibration.from_scores(run["clean_scores"], t) for t in targets]
    return write_bundle(
        out,
        network_dir=run["network_dir"],
        detector=run["detector"],
        calibration=run["calibration"],
        name="tiny",
        dataset="fashion-mnist",
        operating_points=points,
    )


def test_a_bundle_serves_any_of_its_operating_points_and_refuses_others(
    tmp_path: Path, run: dict
) -> None:
    """The thresholds calibrated at other targets on the same clean scores travel in the
    manifest; the Guard flags at the one asked for, at the bundle's own by default, and a target
    it was not calibrated at is refused with the targets it offers."""
    out = _bundle_with_points(tmp_path / "b", run, (0.05, 0.1, 0.3))
    manifest = load_bundle(out).manifest
    assert [p.target_fpr for p in manifest.operating_points] == [0.05, 0.1, 0.3]
    thresholds = {p.target_fpr: p.threshold for p in manifest.operating_points}
    assert thresholds[0.1] == run["calibration"].threshold
    assert thresholds[0.05] > thresholds[0.1] >= thresholds[0.3]  # stricter: higher
    default = Guard.from_bundle(out, device="cpu")
    strict = Guard.from_bundle(out, device="cpu", target_fpr=0.05)
    assert (default.threshold, default.target_fpr) == (run["calibration"].threshold, 0.1)
    assert (strict.threshold, strict.target_fpr) == (thresholds[0.05], 0.05)
    x = np.concatenate([_images(40, 5, False), _images(10, 6, True)])
    loose, tight = default.predict(x), strict.predict(x)
    np.testing.assert_array_equal(loose.scores, tight.scores)  # one score, two decisions
    np.testing.assert_array_equal(tight.flagged, tight.scores > thresholds[0.05])
    np.testing.assert_array_equal(loose.flagged, loose.scores > thresholds[0.1])
    with pytest.raises(
        ConfigError, match=r"no operating point at target FPR 0\.02.*0\.05, 0\.1, 0\.3"
    ):
        Guard.from_bundle(out, device="cpu", target_fpr=0.02)


def _swap_outer_thresholds(points: list[dict]) -> None:
    points[0]["threshold"], points[-1]["threshold"] = (
        points[-1]["threshold"],
        points[0]["threshold"],
    )


def _repeat_a_target(points: list[dict]) -> None:
    points.append(dict(points[0]))


def _move_the_bundles_own(points: list[dict]) -> None:
    points[1]["threshold"] += 1e-3


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (_swap_outer_thresholds, "must not rise"),  # the strictest target at the lowest threshold
        (_repeat_a_target, "repeat a target FPR"),
        (_move_the_bundles_own, "not the bundle's"),
    ],
)
def test_an_edited_operating_point_is_refused(tmp_path: Path, run: dict, edit, problem) -> None:
    """A manifest whose operating points were edited out of what a calibration can give is
    refused on load, naming the problem: the server never flags at a swapped threshold."""
    out = _bundle_with_points(tmp_path / "b", run, (0.05, 0.1, 0.3))
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    edit(manifest["operating_points"])
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ArtefactError, match=problem):
        Guard.from_bundle(out, device="cpu")


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", [networks.WEIGHTS_FILE, DETECTOR_FILE])
def test_tampered_file_is_refused_by_name(bundle_dir: Path, name: str) -> None:
    _flip_byte(bundle_dir / name)
    with pytest.raises(ArtefactError, match=f"checksum mismatch for bundle file {name}"):
        load_bundle(bundle_dir)
    with pytest.raises(ArtefactError, match=name):
        Guard.from_bundle(bundle_dir, device="cpu")


def test_missing_file_is_refused(bundle_dir: Path) -> None:
    (bundle_dir / DETECTOR_FILE).unlink()
    with pytest.raises(ArtefactError, match=f"{DETECTOR_FILE} listed in the manifest is missing"):
        load_bundle(bundle_dir)


def _edit_manifest(bundle_dir: Path, edit) -> None:
    path = bundle_dir / MANIFEST_FILE
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(format_version=2), "unknown bundle format version 2"),
        (
            lambda m: m["network"].update(architecture="resnet1000"),
            "unknown architecture 'resnet1000'",
        ),
        (lambda m: m["files"].pop(DETECTOR_FILE), f"does not list required file.*{DETECTOR_FILE}"),
        (lambda m: m.update(surprise=1), "surprise"),
        # a NaN or infinite threshold would load and flag nothing (or everything), silently
        (lambda m: m.update(threshold=float("nan")), "threshold"),
        (lambda m: m.update(threshold=float("inf")), "threshold"),
        (lambda m: m.update(target_fpr=-3), "target_fpr"),
        (lambda m: m["input_spec"].update(value_range=[0, float("inf")]), "must be finite"),
    ],
)
def test_invalid_manifest_is_refused_with_the_problem(bundle_dir: Path, edit, message: str) -> None:
    _edit_manifest(bundle_dir, edit)
    with pytest.raises(ArtefactError, match=message):
        load_bundle(bundle_dir)


def test_missing_bundle_and_bad_json_are_refused(tmp_path: Path, bundle_dir: Path) -> None:
    with pytest.raises(ArtefactError, match="does not exist"):
        load_bundle(tmp_path / "nowhere")
    (bundle_dir / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ArtefactError, match="not valid JSON"):
        load_bundle(bundle_dir)


def test_detector_of_another_network_is_refused_at_bundling(tmp_path: Path, run: dict) -> None:
    features = np.random.default_rng(0).random((40, 6), dtype=np.float32)  # 3 blocks, not 2
    other = TransportDetector(n_estimators=3).fit(
        features, np.r_[np.zeros(20), np.ones(20)].astype(int), np.zeros(40, int)
    )
    with pytest.raises(ArtefactError, match="fitted on 6 features but this network gives 4"):
        write_bundle(
            tmp_path / "b",
            network_dir=run["network_dir"],
            detector=other,
            calibration=run["calibration"],
            name="x",
            dataset="d",
        )


def test_guard_predict_is_the_network_and_the_detector(bundle_dir: Path, run: dict) -> None:
    guard = Guard.from_bundle(bundle_dir, device="cpu")
    guard.warmup()
    x = np.concatenate([_images(15, 4, False), _images(15, 5, True)])
    result = guard.predict(x)
    with torch.no_grad():
        logits = run["model"](torch.from_numpy(x))
    np.testing.assert_array_equal(result.labels, logits.argmax(1).numpy())
    np.testing.assert_allclose(result.probabilities, torch.softmax(logits, 1).numpy(), atol=1e-5)
    np.testing.assert_allclose(result.confidences, result.probabilities.max(1))
    features, _ = extract_features(run["model"], x)
    np.testing.assert_allclose(
        result.scores, run["detector"].score(features, result.labels), atol=1e-6
    )
    np.testing.assert_array_equal(result.flagged, result.scores > guard.threshold)
    assert result.class_names == [guard.class_names[i] for i in result.labels]
    assert guard.part_scores(x) == {}  # the transport forests have no parts
    assert result.scores.dtype == np.float32 and result.labels.dtype == np.int64
    # Built from in-memory objects, in chunks: the same answers.
    in_memory = Guard.from_run(
        run["network_dir"], run["detector"], run["calibration"], device="cpu"
    )
    in_memory.batch_size = 7
    np.testing.assert_allclose(in_memory.predict(x).scores, result.scores, atol=1e-6)


ALL_GROUPS = FeatureSpec(
    embeddings=True,
    image=True,
    start=True,
    head=True,
    extra_directions=1,
    line_shape=True,
    squeeze=True,
    nss=True,
)


@pytest.mark.parametrize("spec", [FeatureSpec(), ALL_GROUPS], ids=["residues", "all-groups"])
def test_quantile_bundle_round_trip(tmp_path: Path, run: dict, spec: FeatureSpec) -> None:
    """The bundle records its feature spec, and its Guard scores exactly as the detector."""
    clean, _ = extract_features(run["model"], _images(80, 6, False), spec=spec)
    names = spec.names(len(run["model"].blocks))
    detector = QuantileDetector(fpr=0.1).fit(clean, feature_names=names)
    out = write_bundle(
        tmp_path / "q",
        network_dir=run["network_dir"],
        detector=detector,
        calibration=Calibration.from_scores(detector.score(clean), 0.1),
        name="q",
        dataset="d",
        features=spec,
    )
    manifest = load_bundle(out).manifest
    assert manifest.detector.feature_spec == spec
    assert manifest.detector.feature_names == names
    x = _images(10, 7, True)
    features, _ = extract_features(run["model"], x, spec=spec)
    guard = Guard.from_bundle(out, device="cpu")
    np.testing.assert_allclose(guard.predict(x).scores, detector.score(features), atol=1e-5)


@pytest.fixture
def guard(run: dict) -> Guard:
    return Guard.from_run(run["model"], run["detector"], run["calibration"], device="cpu")


def test_prepare_converts_uint8_rgb_to_gray_28(guard: Guard) -> None:
    rgb = np.zeros((32, 32, 3), np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 255, 128, 0
    rgba = np.concatenate([rgb, np.full((32, 32, 1), 255, np.uint8)], axis=2)
    batch = guard.prepare([rgb, rgba, np.full((28, 28), 0.5, np.float32)])
    assert batch.shape == (3, 1, 28, 28) and batch.dtype == torch.float32
    expected = (0.299 * 255 + 0.587 * 128) / 255
    assert torch.allclose(batch[0], torch.full((1, 28, 28), expected), atol=1e-5)
    assert torch.allclose(batch[1], batch[0])
    assert torch.allclose(batch[2], torch.full((1, 28, 28), 0.5))
    assert len(guard.predict_images([rgb]).labels) == 1


def test_prepare_refuses_in_strict_mode_and_bad_pixels(guard: Guard) -> None:
    guard.input_spec = guard.input_spec.model_copy(update={"resize": "strict"})
    assert guard.prepare([np.zeros((28, 28), np.uint8)]).shape == (1, 1, 28, 28)
    with pytest.raises(InputError, match="1x28x28"):
        guard.prepare([np.zeros((32, 32, 3), np.uint8)])
    bad = np.zeros((28, 28), np.float32)
    bad[3, 3] = np.nan
    with pytest.raises(InputError, match="NaN"):
        guard.prepare([bad])
    with pytest.raises(InputError, match="value range"):
        guard.prepare([np.full((28, 28), 200.0, np.float32)])
    with pytest.raises(InputError, match="pixel type"):
        guard.prepare([np.zeros((28, 28), np.int16)])
    with pytest.raises(InputError, match="dimensions"):
        guard.prepare([np.zeros((1, 1, 28, 28), np.uint8)])
    with pytest.raises(InputError, match=r"\[N, 1, 28, 28\]"):
        guard.predict(np.zeros((2, 3, 28, 28), np.float32))


def test_prepare_repeats_gray_into_rgb_and_keeps_rgba_for_four_channels() -> None:
    spec = networks.InputSpec(channels=3, height=16, width=16, mean=[0.5] * 3, std=[0.25] * 3)
    gray = np.full((28, 28), 51, np.uint8)
    batch = prepare_images([gray], spec)
    assert batch.shape == (1, 3, 16, 16) and torch.allclose(batch, torch.full_like(batch, 0.2))
    rgba_spec = spec.model_copy(update={"channels": 4, "mean": [0.5] * 4, "std": [0.25] * 4})
    assert prepare_images([np.zeros((20, 20, 4), np.uint8)], rgba_spec).shape == (1, 4, 16, 16)


def test_scale_uint8_maps_0_and_255_onto_the_value_range() -> None:
    pixels = np.array([[0, 51, 255]], np.uint8)
    scaled = scale_uint8(pixels, (-1.0, 1.0))
    assert scaled.dtype == torch.float32
    torch.testing.assert_close(scaled, torch.tensor([[-1.0, -0.6, 1.0]]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("value_range", [(0.0, 1.0), (-1.0, 1.0)])
def test_quantize_uint8_is_what_the_service_decodes_from_a_png(
    value_range: tuple[float, float],
) -> None:
    """A float image quantized to 8 bits equals the tensor prepared from the PNG a client would
    encode it as; values outside the range clip, and 8-bit images pass unchanged."""
    low, high = value_range
    image = np.random.default_rng(0).uniform(low - 0.1, high + 0.1, (1, 1, 28, 28))
    image = image.astype(np.float32)
    quantized = quantize_uint8(image, value_range)
    spec = networks.InputSpec(
        channels=1, height=28, width=28, mean=[0.5], std=[0.25], value_range=value_range
    )
    png = encode(
        np.round((np.clip(image[0, 0], low, high) - low) / (high - low) * 255).astype(np.uint8)
    )
    decoded = prepare_images([decode_image(png)], spec).numpy()
    assert quantized.dtype == np.float32 and quantized.shape == image.shape
    np.testing.assert_array_equal(quantized, decoded)
    assert np.abs(quantized - np.clip(image, low, high)).max() <= (high - low) / 510 + 1e-6
    np.testing.assert_array_equal(quantize_uint8(quantized, value_range), quantized)


@pytest.mark.parametrize("layout", ["nhw", "nchw", "nhwc"])
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_prepare_of_a_stack_equals_image_by_image(guard: Guard, layout: str, dtype: str) -> None:
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    if dtype == "float32":
        images = images.astype(np.float32) / 255
    stack = {"nhw": images, "nchw": images[:, None], "nhwc": images[..., None]}[layout]
    one_by_one = guard.prepare(list(stack))
    torch.testing.assert_close(guard.prepare(stack), one_by_one, rtol=0, atol=1e-6)
    assert one_by_one.shape == (5, 1, 28, 28)
    with pytest.raises(InputError, match="image 2 contains NaN"):
        bad = stack.astype(np.float32) / (255 if dtype == "uint8" else 1)
        bad[2] = np.nan
        guard.prepare(bad)


# ---- a second network's opinion (detector.opinion): the bundle carries and the Guard runs both ---
OPINION_SPEC = FeatureSpec(head=True, second=True)


@pytest.fixture
def second_bundle(tmp_path: Path, run: dict) -> dict:
    """A quantile bundle on features holding a second network's opinion."""
    second = copy.deepcopy(run["model"])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    second_dir = networks.save(second.eval(), tmp_path / "second")
    clean, _ = extract_features(
        run["model"], _images(80, 6, False), spec=OPINION_SPEC, second=second
    )
    detector = QuantileDetector(fpr=0.1).fit(clean, feature_names=OPINION_SPEC.names(2))
    calibration = Calibration.from_scores(detector.score(clean), 0.1)
    out = write_bundle(
        tmp_path / "two",
        network_dir=run["network_dir"],
        detector=detector,
        calibration=calibration,
        name="two",
        dataset="d",
        features=OPINION_SPEC,
        second_network_dir=second_dir,
    )
    return {"dir": out, "second": second, "second_dir": second_dir, "detector": detector}


def test_second_opinion_bundle_carries_both_networks_and_scores_like_the_detector(
    second_bundle: dict, run: dict
) -> None:
    out = second_bundle["dir"]
    assert SECOND_WEIGHTS_FILE in {p.name for p in out.iterdir()}
    bundle = load_bundle(out)
    assert bundle.manifest.second_network is not None and bundle.manifest.detector.second
    for a, b in zip(
        bundle.second.state_dict().values(),  # type: ignore[union-attr]
        second_bundle["second"].state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b)
    x = np.concatenate([_images(10, 7, True), _images(10, 8, False)])
    features, _ = extract_features(
        run["model"], x, spec=OPINION_SPEC, second=second_bundle["second"]
    )
    expected = second_bundle["detector"].score(features)
    served = Guard.from_bundle(out, device="cpu").predict(x).scores
    np.testing.assert_allclose(served, expected, atol=1e-5)
    in_memory = Guard.from_run(
        run["network_dir"],
        second_bundle["detector"],
        1.0,
        features=OPINION_SPEC,
        second=second_bundle["second_dir"],
    )
    np.testing.assert_allclose(in_memory.predict(x).scores, expected, atol=1e-5)


def test_second_network_is_required_exactly_when_the_features_use_it(
    tmp_path: Path, second_bundle: dict, run: dict
) -> None:
    common = {
        "network_dir": run["network_dir"],
        "detector": second_bundle["detector"],
        "calibration": Calibration.from_scores(np.zeros(10), 0.1),
        "name": "x",
        "dataset": "d",
    }
    with pytest.raises(ConfigError, match="need a second network: pass second_network_dir"):
        write_bundle(tmp_path / "a", features=OPINION_SPEC, **common)
    with pytest.raises(ConfigError, match="use no second network"):
        write_bundle(
            tmp_path / "b",
            features=FeatureSpec(),
            second_network_dir=second_bundle["second_dir"],
            **{**common, "detector": run["detector"]},
        )
    with pytest.raises(ConfigError, match="holds a second network's opinion"):
        Guard.from_run(run["model"], second_bundle["detector"], 1.0, features=OPINION_SPEC)


def test_tampered_second_network_is_refused_by_name(second_bundle: dict) -> None:
    _flip_byte(second_bundle["dir"] / SECOND_WEIGHTS_FILE)
    with pytest.raises(
        ArtefactError, match=f"checksum mismatch for bundle file {SECOND_WEIGHTS_FILE}"
    ):
        Guard.from_bundle(second_bundle["dir"], device="cpu")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.pop("second_network"), "second_network is not set"),
        (lambda m: m["files"].pop(SECOND_WEIGHTS_FILE), f"{SECOND_WEIGHTS_FILE} is not listed"),
        (
            lambda m: m["second_network"].update(class_names=list("abcdefghij")),
            "second network's class names differ",
        ),
        (lambda m: m["detector"].update(second=False), "do not use it"),
    ],
)
def test_inconsistent_second_network_manifest_is_refused(
    second_bundle: dict, edit, message: str
) -> None:
    _edit_manifest(second_bundle["dir"], edit)
    with pytest.raises(ArtefactError, match=message):
        load_bundle(second_bundle["dir"])
