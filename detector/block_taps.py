"""Where the residual branch ends inside the blocks of torchvision and timm classifiers, and tap
name patterns for any other network.

A residual tap is a module whose forward output is exactly the branch r(x) that its block adds
to the (possibly projected) input, ``shortcut(x) + r(x)``, read before the addition:

==========================================================  ===========================================
block (class)                                               taps, in forward order
==========================================================  ===========================================
torchvision ``resnet.BasicBlock`` / ``resnet.Bottleneck``    ``bn2`` / ``bn3`` (ResNet, ResNeXt, Wide ResNet)
torchvision ``vision_transformer.EncoderBlock`` (ViT)        ``dropout`` (attention branch), ``mlp``
torchvision ``convnext.CNBlock``                             ``stochastic_depth``
timm ``resnet.BasicBlock`` / ``resnet.Bottleneck``           ``drop_path``, else ``se``, else ``bn2``/``bn3``
timm ``vision_transformer.Block`` (ViT, DeiT)                ``drop_path1`` (attention branch, after
                                                            ``ls1``), ``drop_path2`` (mlp, after ``ls2``)
timm ``convnext.ConvNeXtBlock``                              ``drop_path`` (after the layer scale gamma)
==========================================================  ===========================================

A ViT block takes two residual steps, x' = x + a(x) then x'' = x' + m(x'): each is a tap, so a
ViT of L blocks has 2L taps. The ResNets of both libraries add the shortcut *in place* into the
tapped tensor (``out += identity``): an :class:`~detector.networks.ImportedNetwork` hands a copy
on while a tap is recorded; on a bare model a hook must reduce or copy what it sees.

Any other network: glob patterns (:mod:`fnmatch`, where ``*`` also crosses dots) over its module
names, e.g. ``"blocks.*.residual"``; the matches are taken in module order (the depth order of
every common architecture). When nothing is known or matches, the error lists candidates: the
last non-shortcut, non-activation module of every block held in a ``Sequential``/``ModuleList``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase

from torch import nn

from detector.errors import ConfigError

BlockEnds = Callable[[nn.Module], list[str]]
CANDIDATES_SHOWN = 8
SHORTCUT_WORDS = ("downsample", "shortcut", "skip")


def _timm_resnet_end(last_norm: str) -> BlockEnds:
    """timm's ResNet blocks: the branch ends in drop_path, else se, else the last norm."""

    def ends(block: nn.Module) -> list[str]:
        for name in ("drop_path", "se"):
            if isinstance(getattr(block, name, None), nn.Module):
                return [name]
        return [last_norm]

    return ends


BLOCK_ENDS: dict[str, BlockEnds] = {
    "torchvision.models.resnet.BasicBlock": lambda _: ["bn2"],
    "torchvision.models.resnet.Bottleneck": lambda _: ["bn3"],
    "torchvision.models.vision_transformer.EncoderBlock": lambda _: ["dropout", "mlp"],
    "torchvision.models.convnext.CNBlock": lambda _: ["stochastic_depth"],
    "timm.models.resnet.BasicBlock": _timm_resnet_end("bn2"),
    "timm.models.resnet.Bottleneck": _timm_resnet_end("bn3"),
    "timm.models.vision_transformer.Block": lambda _: ["drop_path1", "drop_path2"],
    "timm.models.convnext.ConvNeXtBlock": lambda _: ["drop_path"],
}


def _block_ends(module: nn.Module) -> BlockEnds | None:
    """The tap rule of a known block class (or of a class it derives from)."""
    for cls in type(module).__mro__:
        rule = BLOCK_ENDS.get(f"{cls.__module__}.{cls.__qualname__}")
        if rule is not None:
            return rule
    return None


def known_residual_taps(model: nn.Module) -> list[str]:
    """Tap names of every known torchvision/timm block in ``model``, in module order ([] if none)."""
    names: list[str] = []
    for name, module in model.named_modules():
        rule = _block_ends(module)
        if rule is not None:
            names += [f"{name}.{end}" if name else end for end in rule(module)]
    return names


def match_taps(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Module names matching any glob pattern, in module order; a pattern matching nothing is a
    ConfigError listing candidates."""
    names = [name for name, _ in model.named_modules() if name]
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in names):
            raise ConfigError(
                f"tap pattern {pattern!r} matches no module of {type(model).__name__}; "
                f"{candidates_hint(model)}"
            )
    return [name for name in names if any(fnmatchcase(name, p) for p in patterns)]


def block_end_candidates(model: nn.Module) -> list[str]:
    """Modules that look like the end of a residual branch: in every block held by a
    ``Sequential`` or ``ModuleList``, its last child that is neither a shortcut nor an activation."""
    found: list[str] = []
    for name, container in model.named_modules():
        if not isinstance(container, nn.Sequential | nn.ModuleList):
            continue
        for index, block in container.named_children():
            ends = [
                child
                for child, module in block.named_children()
                if not any(word in child for word in SHORTCUT_WORDS)
                and type(module).__module__ != nn.ReLU.__module__  # torch.nn's activations
            ]
            if ends:
                found.append(".".join(part for part in (name, index, ends[-1]) if part))
    return found


def candidates_hint(model: nn.Module) -> str:
    """One clause naming a few candidate taps of ``model`` (or its top-level modules)."""
    found = block_end_candidates(model)
    what = "modules ending a repeated block"
    if not found:
        found, what = [name for name, _ in model.named_children()], "its top-level modules"
    shown = ", ".join(found[:CANDIDATES_SHOWN])
    more = f" (+{len(found) - CANDIDATES_SHOWN} more)" if len(found) > CANDIDATES_SHOWN else ""
    return f"candidates ({what}): {shown or 'none'}{more}"


def residual_taps(model: nn.Module, patterns: Sequence[str] | None = None) -> list[str]:
    """The residual taps of ``model``: the modules matching ``patterns`` when given, else those of
    its known torchvision/timm blocks; ConfigError (listing candidates) when there are none."""
    if patterns:
        return match_taps(model, patterns)
    names = known_residual_taps(model)
    if not names:
        raise ConfigError(
            f"no residual taps known for {type(model).__name__}: pass tap names explicitly, or "
            "patterns (modules whose output is a block's residual branch, before it is added); "
            f"{candidates_hint(model)}"
        )
    return names
