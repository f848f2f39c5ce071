"""The residual taps of torchvision and timm blocks, checked numerically: for every block, its
input and what its taps see recompose its output (x + r(x), with the block's own shortcut and
post-activation; a ViT block's two branches: x + a + m). Plus tap name patterns and the error
that lists candidates."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models import convnext as tv_convnext
from torchvision.models import resnet as tv_resnet
from torchvision.models import vision_transformer as tv_vit

from detector.block_taps import known_residual_taps, match_taps, residual_taps
from detector.errors import ConfigError
from detector.taps import Tap, Taps, default_tap_names

Recompose = Callable[[nn.Module, torch.Tensor, list[torch.Tensor]], torch.Tensor]


def _shortcut(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for name in ("downsample", "shortcut"):
        module = getattr(block, name, None)
        if isinstance(module, nn.Module):
            return module(x)
    return x


def _post_relu(block: nn.Module, x: torch.Tensor, r: list[torch.Tensor]) -> torch.Tensor:
    return torch.relu(_shortcut(block, x) + r[0])


def _plain_add(block: nn.Module, x: torch.Tensor, r: list[torch.Tensor]) -> torch.Tensor:
    return _shortcut(block, x) + r[0]


def _two_branches(block: nn.Module, x: torch.Tensor, r: list[torch.Tensor]) -> torch.Tensor:
    return x + r[0] + r[1]  # x' = x + a(x); x'' = x' + m(x')


def _tiny_torchvision_vit() -> nn.Module:
    return tv_vit.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=10,
    )  # fmt: skip


def _tiny_torchvision_convnext() -> nn.Module:
    setting = [tv_convnext.CNBlockConfig(8, 16, 2), tv_convnext.CNBlockConfig(16, None, 1)]
    return tv_convnext.ConvNeXt(setting, layer_scale=0.5, num_classes=10)


def _tiny_resnext() -> nn.Module:  # torchvision's ResNeXt/Wide ResNet: Bottleneck with groups/width
    return tv_resnet.ResNet(
        tv_resnet.Bottleneck, [2, 1, 1, 1], num_classes=10, groups=2, width_per_group=8
    )


# (model, block class, recompose, taps per block)
TORCHVISION = {
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), tv_resnet.BasicBlock, _post_relu, 1),
    "resnext": (_tiny_resnext, tv_resnet.Bottleneck, _post_relu, 1),
    "vit": (_tiny_torchvision_vit, tv_vit.EncoderBlock, _two_branches, 2),
    "convnext": (_tiny_torchvision_convnext, tv_convnext.CNBlock, _plain_add, 1),
}  # fmt: skip


def _timm_cases() -> dict[str, tuple]:
    timm = pytest.importorskip("timm")
    from timm.models import convnext, resnet, vision_transformer

    def act(name: str) -> Recompose:
        return lambda b, x, r: getattr(b, name)(_shortcut(b, x) + r[0])

    def create(name: str, **kwargs) -> Callable[[], nn.Module]:
        return lambda: timm.create_model(name, pretrained=False, num_classes=10, **kwargs)

    vit = {"img_size": 32, "patch_size": 8, "depth": 2, "num_heads": 2, "embed_dim": 32}
    tiny_convnext = {"depths": (1, 1, 2, 1), "dims": (8, 16, 24, 32), "ls_init_value": 0.5}
    return {
        "timm-resnet18": (create("resnet18"), resnet.BasicBlock, act("act2"), 1),
        "timm-resnet18-droppath": (create("resnet18", drop_path_rate=0.1), resnet.BasicBlock, act("act2"), 1),
        "timm-seresnet": (create("seresnet18"), resnet.BasicBlock, act("act2"), 1),
        "timm-bottleneck": (create("resnet26", drop_path_rate=0.1), resnet.Bottleneck, act("act3"), 1),
        "timm-vit": (create("vit_tiny_patch16_224", **vit), vision_transformer.Block, _two_branches, 2),
        "timm-vit-layerscale": (
            create("vit_tiny_patch16_224", init_values=0.5, drop_path_rate=0.1, **vit),
            vision_transformer.Block, _two_branches, 2,
        ),
        "timm-convnext": (
            create("convnext_atto", drop_path_rate=0.1, **tiny_convnext),
            convnext.ConvNeXtBlock, _plain_add, 1,
        ),
    }  # fmt: skip


TIMM = ["timm-resnet18", "timm-resnet18-droppath", "timm-seresnet", "timm-bottleneck"]
TIMM += ["timm-vit", "timm-vit-layerscale", "timm-convnext"]


def _case(name: str) -> tuple:
    return TORCHVISION[name] if name in TORCHVISION else _timm_cases()[name]


def _randomize_norms(model: nn.Module) -> None:
    """Non-trivial BatchNorm statistics, so an eval-mode residual is not a near-copy of its input."""
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.copy_(torch.randn(module.num_features, generator=generator) * 0.1)
            module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
            module.weight.data.copy_(torch.randn(module.num_features, generator=generator))


@pytest.mark.parametrize("name", [*TORCHVISION, *TIMM])
def test_each_tap_sees_exactly_its_blocks_residual_branch(name: str) -> None:
    torch.manual_seed(0)
    build, block_class, recompose, per_block = _case(name)
    model = build().eval()
    _randomize_norms(model)
    blocks = [n for n, m in model.named_modules() if type(m) is block_class]
    taps = known_residual_taps(model)
    assert len(blocks) >= 2 and len(taps) == per_block * len(blocks)
    assert default_tap_names(model) == taps
    points = [Tap(b, on) for b in blocks for on in ("input", "output")] + [Tap(t) for t in taps]
    x = torch.rand(2, 3, 32, 32)
    # clone inside the hook: ResNets add the shortcut in place into the tapped tensor
    with torch.no_grad(), Taps(model, points, transform=torch.clone) as seen:
        model(x)
        values = dict(zip([f"{p.module}:{p.on}" for p in points], seen.outputs, strict=True))
        modules = dict(model.named_modules())
        for block in blocks:
            residuals = [values[f"{t}:output"] for t in taps if t.rsplit(".", 1)[0] == block]
            assert len(residuals) == per_block
            rebuilt = recompose(modules[block], values[f"{block}:input"], residuals)
            out = values[f"{block}:output"]
            assert torch.allclose(rebuilt, out, atol=1e-5), (block, (rebuilt - out).abs().max())
            assert all(r.abs().max() > 1e-4 for r in residuals)  # a real branch, not zeros


def test_vit_taps_are_in_depth_order_attention_then_mlp() -> None:
    taps = known_residual_taps(_tiny_torchvision_vit())
    assert taps == [
        "encoder.layers.encoder_layer_0.dropout",
        "encoder.layers.encoder_layer_0.mlp",
        "encoder.layers.encoder_layer_1.dropout",
        "encoder.layers.encoder_layer_1.mlp",
    ]


class _Plain(nn.Module):
    """A residual network of no known library: taps need patterns."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
            for _ in range(3)
        )
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = x + stage(x)
        return self.head(x.mean((2, 3)))


def test_patterns_select_modules_in_module_order() -> None:
    model = _Plain()
    assert match_taps(model, ["stages.*.1"]) == ["stages.0.1", "stages.1.1", "stages.2.1"]
    assert residual_taps(model, ["stages.2.1", "stages.0.1"]) == ["stages.0.1", "stages.2.1"]


def test_a_network_without_known_taps_lists_candidates() -> None:
    with pytest.raises(ConfigError) as caught:
        residual_taps(_Plain())
    message = str(caught.value)
    assert "\n" not in message
    assert "no residual taps known for _Plain" in message
    assert (
        "candidates (modules ending a repeated block): stages.0.1, stages.1.1, stages.2.1"
        in message
    )


def test_a_pattern_matching_nothing_names_it_and_lists_candidates() -> None:
    with pytest.raises(ConfigError) as caught:
        residual_taps(torchvision.models.resnet18(num_classes=10), ["layer*.*.bn9"])
    message = str(caught.value)
    assert "\n" not in message
    assert "tap pattern 'layer*.*.bn9' matches no module of ResNet" in message
    assert "layer1.0.bn2, layer1.1.bn2" in message
