"""`lapguard import`: the user's own torchvision/timm network and weights file become a network
directory that `networks.load` rebuilds with the same logits, the user's state-dict keys and
working taps; every refusal is one line and writes nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from safetensors.torch import save_file
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from detector import networks
from detector.block_taps import known_residual_taps
from detector.features import FeatureSpec, TransportFeatureExtractor, extract_features
from detector.networks import ImportedNetwork, InputSpec, NetworkConfig
from detector.taps import ResidualTaps, Tap, Taps
from tests.service_helpers import noise_bundle
from training.cli.main import main

IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
VIT = {"image_size": 32, "patch_size": 8, "num_layers": 2, "num_heads": 2, "hidden_dim": 32}
VIT_ARGS = [f"--arg={k}={v}" for k, v in {**VIT, "mlp_dim": 64}.items()]


def _settled(model: nn.Module) -> nn.Module:
    """A few forward passes in train mode (non-trivial BatchNorm statistics), then eval mode."""
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.rand(8, 3, 32, 32))
    return model.eval()


def _resnet18() -> nn.Module:
    torch.manual_seed(0)
    return _settled(torchvision.models.resnet18(num_classes=10))


def _vit() -> nn.Module:
    torch.manual_seed(0)
    return VisionTransformer(**VIT, mlp_dim=64, num_classes=10).eval()


# name: (user's network, ARCH, extra arguments, residual taps)
CASES = {
    "resnet18": (_resnet18, "torchvision:resnet18", [], 8),
    "vit": (_vit, "torchvision:VisionTransformer", VIT_ARGS, 4),
}


def _save(model: nn.Module, folder: Path, fmt: str) -> Path:
    """The user's file: ``torch.save(model.state_dict())`` or ``safetensors``."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if fmt == "safetensors":
        save_file(state, str(folder / "weights.safetensors"))
        return folder / "weights.safetensors"
    torch.save(state if fmt == "pt" else {"epoch": 3, "state_dict": state}, folder / "weights.pt")
    return folder / "weights.pt"


def _import(arch: str, weights: Path, out: Path, *extra: str) -> int:
    return main(["import", arch, "--weights", str(weights), "--out", str(out), *extra])


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_imported_network_reloads_with_the_same_logits_and_taps(
    case: str, fmt: str, tmp_path: Path, capsys
) -> None:
    build, arch, extra, n_taps = CASES[case]
    model = build()
    weights = _save(model, tmp_path / "user", fmt)
    assert _import(arch, weights, tmp_path / "net", "--input-size", "32", *extra) == 0
    printed = capsys.readouterr().out
    assert f"imported {arch} into {tmp_path / 'net'}" in printed
    assert "classes  10: 0, 1, 2" in printed and f"{n_taps} residual taps" in printed
    assert "not given, so from" in printed and "mean [0.485, 0.456, 0.406]" in printed

    loaded = networks.load(tmp_path / "net")
    assert isinstance(loaded, ImportedNetwork)
    assert list(loaded.state_dict()) == list(model.state_dict())  # the user's keys, no prefix
    assert loaded.config is not None and loaded.config.taps == known_residual_taps(model)
    x = torch.rand(5, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(loaded(x), model((x - IMAGENET_MEAN) / IMAGENET_STD), atol=1e-5)
    features, logits = extract_features(loaded, x.numpy())
    assert features.shape == (5, 2 * n_taps) and np.isfinite(features).all()
    assert logits.shape == (5, 10)


def test_given_spec_classes_and_tap_patterns_are_kept(tmp_path: Path, capsys) -> None:
    """A checkpoint dict holding the state dict; explicit everything; nothing chosen for the user."""
    model = _resnet18()
    weights = _save(model, tmp_path / "user", "checkpoint")
    classes = [f"c{i}" for i in range(10)]
    spec = ["--channels", "3", "--input-size", "32", "40", "--mean", "0.5", "0.4", "0.3"]
    spec += ["--std", "0.2", "0.2", "0.2", "--classes", *classes, "--taps", "layer[34].*.bn2"]
    spec += ["--crop", "none"]
    assert _import("torchvision:resnet18", weights, tmp_path / "net", *spec) == 0
    assert "not given" not in capsys.readouterr().out
    config = networks.read_config(tmp_path / "net")
    assert config.class_names == classes and config.taps == [
        "layer3.0.bn2", "layer3.1.bn2", "layer4.0.bn2", "layer4.1.bn2",
    ]  # fmt: skip
    assert (config.input_spec.height, config.input_spec.width) == (32, 40)
    assert config.input_spec.mean == [0.5, 0.4, 0.3]
    assert (config.input_spec.resize_to, config.input_spec.crop) == (None, None)  # a stretch
    assert networks.load(tmp_path / "net").tap_names()[0] == "model.layer3.0.bn2"


def test_the_wrapper_loads_the_users_keys_also_inside_another_module() -> None:
    model = _vit()
    inner = ImportedNetwork(_vit(), mean=[0.5] * 3, std=[0.5] * 3, taps=known_residual_taps(model))
    inner.load_state_dict(model.state_dict())
    parent = nn.Sequential(inner)
    state = parent.state_dict()
    assert set(state) == {f"0.{key}" for key in model.state_dict()}
    fresh = nn.Sequential(ImportedNetwork(_vit(), mean=[0.5] * 3, std=[0.5] * 3, taps=["encoder"]))
    fresh.load_state_dict(state)
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(fresh(x), parent(x))


def test_recorded_residuals_survive_in_place_shortcut_adds_and_carry_gradients() -> None:
    """torchvision's ResNet blocks add the shortcut into the tapped tensor in place; the imported
    network hands a copy on, so a kept residual is still r(x) and gradients flow through it."""
    model = _resnet18()
    network = ImportedNetwork(model, mean=[0.5] * 3, std=[0.5] * 3, taps=known_residual_taps(model))
    x = torch.rand(2, 3, 32, 32, requires_grad=True)
    block = [Tap("model.layer1.1", "input"), Tap("model.layer1.1", "output")]
    with ResidualTaps(network) as taps, Taps(network, block) as ends:
        network(x)
        residual = taps.outputs[1]  # layer1.1.bn2, kept as it is (no transform)
        start, end = ends.outputs
    assert torch.allclose(torch.relu(start + residual), end, atol=1e-6)
    assert residual.min() < 0  # not the in-place ReLU's output
    with TransportFeatureExtractor(network) as fx:
        network(x)
        fx.features().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_a_reducing_recorder_without_gradients_needs_no_copy_and_reads_the_same() -> None:
    """The Guard's pass (inference mode, every tap reduced at once) hands the tap's own tensor on,
    with the features of the copying pass; a recorder that keeps the tensor still gets a copy."""
    model = _resnet18()
    network = ImportedNetwork(model, mean=[0.5] * 3, std=[0.5] * 3, taps=known_residual_taps(model))
    x = torch.rand(3, 3, 32, 32)
    spec = FeatureSpec(embeddings=True, line_shape=True, extra_directions=2)
    tap = dict(network.named_modules())["model.layer1.0.bn2"]
    seen: list[int] = []  # the tensor's address as the tap made it, then as its block gets it
    probes = [
        tap.register_forward_hook(lambda _m, _i, out: seen.append(out.data_ptr()), prepend=True),
        tap.register_forward_hook(lambda _m, _i, out: seen.append(out.data_ptr())),
    ]
    with TransportFeatureExtractor(network, spec) as fx:
        network(x)
        copied = fx.features().detach()
    assert seen[0] != seen[1]  # gradients on: a copy goes on
    seen.clear()
    with torch.inference_mode(), TransportFeatureExtractor(network, spec) as fx:
        network(x)
        torch.testing.assert_close(fx.features(), copied, rtol=1e-5, atol=1e-6)
    assert seen[0] == seen[1]  # reduced at once, no gradients: no copy
    seen.clear()
    with torch.no_grad(), ResidualTaps(network, transform=torch.Tensor.detach) as taps:
        network(x)
        kept = taps.outputs[0]
    assert seen[0] != seen[1]  # a view of it is kept: a copy goes on
    for probe in probes:
        probe.remove()
    with torch.no_grad(), ResidualTaps(network, transform=torch.clone) as taps:
        network(x)
        torch.testing.assert_close(kept, taps.outputs[0])  # not changed by `out += identity`


def test_an_imported_network_serves_through_a_bundle_and_the_guard(tmp_path: Path) -> None:
    from detector.guard import Guard

    weights = _save(_vit(), tmp_path / "user", "pt")
    assert _import("torchvision:VisionTransformer", weights, tmp_path / "net", *VIT_ARGS) == 0
    bundle, clean = noise_bundle(
        tmp_path / "net",
        tmp_path / "bundle",
        (40, 3, 32, 32),
        min_class_samples=50,
        name="imported-vit",
    )
    _, l_clean = extract_features(networks.load(tmp_path / "net"), clean[:6])
    result = Guard.from_bundle(bundle, device="cpu").predict(clean[:6])
    assert (result.labels == l_clean[:6].argmax(1)).all()
    assert np.isfinite(result.scores).all() and result.blocks is not None
    assert result.blocks.shape == (6, 2, 4)  # (msq, cos) of the 4 taps: 2 blocks x 2 branches


def test_a_timm_network_takes_timms_data_config(tmp_path: Path, capsys) -> None:
    timm = pytest.importorskip("timm")
    vit = {"img_size": 32, "patch_size": 8, "depth": 2, "num_heads": 2, "embed_dim": 32}
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, **vit)
    weights = _save(model.eval(), tmp_path / "user", "safetensors")
    extra = [f"--arg={k}={v}" for k, v in vit.items()]
    assert _import("timm:vit_tiny_patch16_224", weights, tmp_path / "net", *extra) == 0
    printed = capsys.readouterr().out
    assert (
        "timm's data config" in printed and "size 32x32" in printed and "4 residual taps" in printed
    )
    assert "resize shorter side to 35 then centre crop 32x32 (antialiased bicubic)" in printed
    loaded = networks.load(tmp_path / "net")
    assert loaded.config is not None and loaded.config.input_spec.mean == [0.5, 0.5, 0.5]
    spec = loaded.config.input_spec  # crop_pct 0.9, floored as timm does: 32 / 0.9 -> 35
    assert (spec.resize_to, spec.crop, spec.interpolation) == (35, "center", "bicubic")
    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(loaded(x), model((x - 0.5) / 0.5), atol=1e-5)


# ---- refusals: one line, nothing written ----------------------------------------------------
@pytest.fixture(scope="module")
def user_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("user")
    model = _resnet18()
    torch.save(model, folder / "whole.pt")
    (folder / "junk.pt").write_bytes(b"not a checkpoint at all")
    torch.save({"epoch": 1, "note": "no tensors"}, folder / "meta.pt")
    return {"weights": _save(model, folder, "pt"), "folder": folder}


REFUSALS = [
    (["torchvision:resnet18", "{whole}"], "holds pickled Python objects (torchvision.models.resnet.ResNet; e.g. a whole module saved with torch.save(model))"),
    (["torchvision:resnet18", "{junk}"], "not a .safetensors file or a torch state dict"),
    (["torchvision:resnet18", "{meta}"], "is not a plain state dict (entries that are not tensors: epoch, note)"),
    (["torchvision:resnet18", "{missing}"], "no weights file at"),
    (["torchvision:resnet34", "{weights}"], "do not fit: missing layer1.2.conv1.weight"),
    (["torchvision:resnet18", "{weights}", "--num-classes", "7"], "mis-shaped fc.weight (file [10, 512], network [7, 512])"),
    (["torchvision:resnet19", "{weights}"], "unknown torchvision architecture 'resnet19'; did you mean torchvision:resnet18"),
    (["resnet18", "{weights}"], "import takes torchvision:NAME or timm:NAME"),
    (["torchvision:resnet18", "{weights}", "--taps", "layer*.conv9"], "tap pattern 'layer*.conv9' matches no module of ResNet; candidates (modules ending a repeated block): layer1.0.bn2"),
    (["torchvision:resnet18", "{weights}", "--arg", "weights=DEFAULT"], "takes its weights from your file only"),
    (["torchvision:resnet18", "{weights}", "--arg", "colour"], "--arg expects KEY=VALUE"),
    (["torchvision:resnet18", "{weights}", "--classes", "a", "b", "--num-classes", "10"], "the class counts disagree: --classes 2, --num-classes 10"),
    (["torchvision:resnet18", "{weights}", "--channels", "1"], "does not run on 1x224x224 images"),
    (["torchvision:resnet18", "{weights}", "--std", "0", "1", "1"], "bad input spec: mean/std: Value error, std values must be positive"),
    (["torchvision:resnet18", "{weights}", "--resize-to", "200"], "bad resize policy (--resize-to/--crop): resize_to 200 is smaller than the 224x224 crop"),
    (["torchvision:resnet18", "{weights}", "--resize-to", "256", "--crop", "none"], "--resize-to resizes before a centre crop: drop it or give --crop center"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "needle"), REFUSALS)
def test_a_refusal_is_one_line_and_writes_nothing(
    argv: list[str], needle: str, user_files: dict[str, Path], tmp_path: Path, capsys
) -> None:
    folder = user_files["folder"]
    files = {name: str(folder / f"{name}.pt") for name in ("whole", "junk", "meta", "missing")}
    arch, weights, *extra = argv
    weights = weights.format(weights=user_files["weights"], **files)
    assert _import(arch, Path(weights), tmp_path / "out" / "net", *extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lapguard import: error: ") and "\n" not in err, err
    assert needle in err
    assert list(tmp_path.iterdir()) == []


def test_a_full_out_directory_is_refused(
    user_files: dict[str, Path], tmp_path: Path, capsys
) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "mine.txt").write_text("keep")
    assert _import("torchvision:resnet18", user_files["weights"], tmp_path / "net") == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "net").iterdir()] == ["mine.txt"]


def test_without_timm_the_error_says_how_to_install_it(
    user_files: dict[str, Path], tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm -> ImportError
    assert _import("timm:resnet18", user_files["weights"], tmp_path / "net") == 2
    assert "pip install 'lapguard[timm]'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_configs_keep_taps_and_class_counts_consistent() -> None:
    spec = InputSpec(channels=3, height=32, width=32, mean=[0.5] * 3, std=[0.5] * 3)
    common = {"class_names": ["a", "b"], "input_spec": spec}
    with pytest.raises(ValueError, match="taps are stored for torchvision:/timm: networks only"):
        NetworkConfig(architecture="resnet9_mnist", taps=["blocks.0"], **common)
    with pytest.raises(ValueError, match="arguments.num_classes is 3 but there are 2 class names"):
        NetworkConfig(architecture="torchvision:resnet18", arguments={"num_classes": 3}, **common)
    with pytest.raises(ValueError, match="did you mean torchvision:resnet18"):
        NetworkConfig(architecture="torchvision:resnet81", **common)


# ---- how uploads of another size are resized ------------------------------------------------
POLICIES = [
    ([], (256, "center"), "resize shorter side to 256 then centre crop 224x224"),
    (["--input-size", "64"], (73, "center"), "resize shorter side to 73 then centre crop 64x64"),
    (["--resize-to", "300"], (300, "center"), None),
    (["--crop", "center", "--input-size", "32"], (37, "center"), None),
    (["--crop", "none"], (None, None), None),
]


@pytest.mark.parametrize(("flags", "policy", "printed"), POLICIES)
def test_torchvisions_eval_transform_sets_the_resize_unless_given(
    flags: list[str],
    policy: tuple,
    printed: str | None,
    user_files: dict[str, Path],
    tmp_path: Path,
    capsys,
) -> None:
    """resnet18's weights resize the shorter side to 256 and crop 224: the ratio is kept at other
    sizes (round(64 / 0.875) = 73); --resize-to/--crop win and are not reported as chosen."""
    assert _import("torchvision:resnet18", user_files["weights"], tmp_path / "net", *flags) == 0
    out = capsys.readouterr().out
    spec = networks.read_config(tmp_path / "net").input_spec
    assert (spec.resize_to, spec.crop, spec.interpolation) == (*policy, None)
    assert ("resize shorter" in out.split("imported")[0]) == (printed is not None)
    if printed is not None:
        assert f"{printed} (antialiased bilinear)" in out
    assert f"  resize   {spec.describe_resize()}" in out
