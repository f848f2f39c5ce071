"""Residual taps: the one way to see every block's residual r_m(x_m) during a forward pass.

A tap specification is a list of module names whose forward output is the residual branch
(before the step size and the addition). Our networks and imported ones name theirs
(``tap_names()``); the blocks of plain torchvision and timm classifiers have known taps
(:mod:`detector.block_taps`: e.g. ``bn2``/``bn3`` of a ResNet block, the residual before
``out += identity``). :class:`Taps` is the one way
to hook a model (residuals, other layers' outputs or inputs); hooks live only inside the
``with`` block, so a model is never left instrumented.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from detector.block_taps import residual_taps
from detector.errors import ConfigError
from detector.networks import KEEPS_TENSOR

Transform = Callable[[torch.Tensor], Any]
Self = TypeVar("Self", bound="Taps")


def default_tap_names(model: nn.Module) -> list[str]:
    """Tap names of a network that names them (``tap_names()``: ours, imported ones), else those
    of its known torchvision/timm blocks; other models need an explicit list."""
    tap_names = getattr(model, "tap_names", None)
    if callable(tap_names):
        return list(tap_names())
    return residual_taps(model)


@dataclass(frozen=True)
class Tap:
    """Where a hook reads: the ``output`` of module ``module`` or its first positional ``input``
    ("" names the model itself, so ``Tap("", "input")`` sees every forward pass start)."""

    module: str
    on: Literal["input", "output"] = "output"


class Taps:
    """The one hook helper: a context manager recording (a transform of) what each tap sees.

    ``transform`` runs inside the hook (e.g. a reduction), so the full tensor need not be kept;
    by default the tensor itself is kept, with its autograd graph. ``reduces`` says that the
    transform returns new tensors that share nothing with what it saw (a reduction, not a view),
    so a network that adds into the tapped tensor in place need not copy it first when no
    gradient flows. Hooks exist only inside the ``with`` block, so a model is never left
    instrumented; ``outputs`` are in tap order.
    """

    def __init__(
        self,
        model: nn.Module,
        taps: Sequence[str | Tap],
        *,
        transform: Transform | None = None,
        reduces: bool = False,
    ) -> None:
        self.model = model
        self.taps = [tap if isinstance(tap, Tap) else Tap(tap) for tap in taps]
        self.transform = transform
        self.reduces = reduces and transform is not None
        modules = dict(model.named_modules())
        missing = [tap.module for tap in self.taps if tap.module not in modules]
        if missing:
            raise ConfigError(
                f"tap modules not found in {type(model).__name__}: {', '.join(missing)}"
            )
        self._modules = [modules[tap.module] for tap in self.taps]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._outputs: list[Any] = [None] * len(self.taps)

    @property
    def names(self) -> list[str]:
        """The tapped module names, in tap order."""
        return [tap.module for tap in self.taps]

    def _record(self, index: int, value: torch.Tensor) -> None:
        self._outputs[index] = value if self.transform is None else self.transform(value)

    def __enter__(self: Self) -> Self:
        for index, (tap, module) in enumerate(zip(self.taps, self._modules, strict=True)):
            # prepended: a recorder sees a tap's output before a network's own hook hands a copy
            # on (ImportedNetwork, whose blocks may add their shortcut in place)
            if tap.on == "input":
                handle = module.register_forward_pre_hook(
                    lambda _m, inputs, i=index: self._record(i, inputs[0]), prepend=True
                )
            else:
                handle = module.register_forward_hook(self._recorder(index), prepend=True)
            self._handles.append(handle)
        return self

    def _recorder(self, index: int) -> Callable[..., None]:
        """The forward hook recording tap ``index``'s output, marked when what it records may
        share the tensor (unless ``reduces``), so a network that adds in place after the tap
        copies it first."""

        def record(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            self._record(index, output)

        setattr(record, KEEPS_TENSOR, not self.reduces)
        return record

    def __exit__(self, *exc: object) -> None:
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
        """Forget the last pass (frees the recorded tensors and their graphs)."""
        self._outputs = [None] * len(self.taps)


class ResidualTaps(Taps):
    """:class:`Taps` on the residual branches (``default_tap_names`` unless ``names`` given)."""

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[str] | None = None,
        *,
        transform: Transform | None = None,
        reduces: bool = False,
    ) -> None:
        super().__init__(
            model,
            list(names) if names is not None else default_tap_names(model),
            transform=transform,
            reduces=reduces,
        )
