"""Residual taps: the one way to see every block's residual r_m(x_m) during a forward pass.

A tap specification is a list of module names whose forward output is the residual branch
(before the step size and the addition). Our networks name theirs ``blocks.{m}.residual``;
torchvision ResNet/ResNeXt/WideResNet blocks end their branch in ``bn2`` (BasicBlock) or ``bn3``
(Bottleneck), which is the residual before ``out += identity``. Hooks live only inside the
``with`` block, so a model is never left instrumented.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from detector.errors import ConfigError

Transform = Callable[[torch.Tensor], Any]


def default_tap_names(model: nn.Module) -> list[str]:
    """Tap names for our networks and torchvision ResNets; other models need an explicit list."""
    tap_names = getattr(model, "tap_names", None)
    if callable(tap_names):
        names = tap_names()
        return list(names)
    from torchvision.models.resnet import BasicBlock, Bottleneck

    names = []
    for name, module in model.named_modules():
        if isinstance(module, BasicBlock):
            names.append(f"{name}.bn2")
        elif isinstance(module, Bottleneck):
            names.append(f"{name}.bn3")
    if not names:
        raise ConfigError(
            f"no residual taps known for {type(model).__name__}: pass tap names explicitly "
            "(modules whose output is the residual branch, before it is added to the input)"
        )
    return names


class ResidualTaps:
    """Context manager that records (a transform of) each tapped module's output, in tap order.

    ``transform`` runs inside the hook (e.g. a reduction), so the full residual tensor need not
    be kept; by default the tensor itself is kept, with its autograd graph, for training losses.
    """

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[str] | None = None,
        *,
        transform: Transform | None = None,
    ) -> None:
        self.model = model
        self.names = list(names) if names is not None else default_tap_names(model)
        self.transform = transform
        modules = dict(model.named_modules())
        missing = [n for n in self.names if n not in modules]
        if missing:
            raise ConfigError(
                f"tap modules not found in {type(model).__name__}: {', '.join(missing)}"
            )
        self._modules = [modules[n] for n in self.names]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._outputs: list[Any] = [None] * len(self.names)

    def _hook(self, index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            self._outputs[index] = output if self.transform is None else self.transform(output)

        return hook

    def __enter__(self) -> ResidualTaps:
        for index, module in enumerate(self._modules):
            self._handles.append(module.register_forward_hook(self._hook(index)))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def outputs(self) -> list[Any]:
        """What each tap recorded in the last forward pass, in tap order."""
        if any(o is None for o in self._outputs):
            raise RuntimeError("no forward pass has gone through every tap inside this context")
        return list(self._outputs)

    def clear(self) -> None:
        """Forget the last pass (frees the residual tensors and their graphs)."""
        self._outputs = [None] * len(self.names)
