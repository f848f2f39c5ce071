"""Weight initialization schemes of seed 003 appendix H.1 (Kaiming or orthogonal, with a gain)."""

from __future__ import annotations

from torch import nn

from detector.errors import ConfigError


def init_weights(model: nn.Module, scheme: str = "kaiming", gain: float = 1.0) -> nn.Module:
    """Initialize conv/linear weights (biases to zero, BatchNorm to identity); ``default`` keeps PyTorch's."""
    if scheme == "default":
        return model
    if scheme not in ("kaiming", "orthogonal"):
        raise ConfigError(f"unknown init scheme {scheme!r}: use default, kaiming or orthogonal")
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            if scheme == "kaiming":
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                module.weight.data.mul_(gain)
            else:
                nn.init.orthogonal_(module.weight, gain=gain)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    return model
