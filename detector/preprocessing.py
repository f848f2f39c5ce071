"""Images as they come (uint8 or floats; HW, HWC or CHW; any size) -> the network's input spec.

The ONE conversion of pixels to a batch: :meth:`detector.guard.Guard.prepare`, the service and
batch scoring all call :func:`prepare_images` (or :func:`scale_uint8` for the value-range scaling
alone), so the same image gives the same tensor everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from detector.errors import InputError
from detector.networks import InputSpec

# ITU-R 601-2 luma, as PIL's "L" conversion.
LUMA = (0.299, 0.587, 0.114)


def scale_uint8(pixels: np.ndarray, value_range: tuple[float, float]) -> torch.Tensor:
    """uint8 pixels (0..255, any layout) as float32 in ``value_range``, linearly."""
    low, high = value_range
    x = torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32))
    return x * ((high - low) / 255.0) + low


def quantize_uint8(images: np.ndarray, value_range: tuple[float, float] = (0.0, 1.0)) -> np.ndarray:
    """Float images in ``value_range`` as a client sending 8-bit images (PNG) sends them: clipped,
    rounded to the nearest of 256 levels, and scaled back by :func:`scale_uint8` (the tensor the
    service decodes from that PNG), float32 of the same shape."""
    low, high = value_range
    levels = (np.clip(images, low, high) - low) * (255.0 / (high - low))
    return scale_uint8(np.round(levels).astype(np.uint8), value_range).numpy()


def prepare_images(images: Sequence[np.ndarray] | np.ndarray, spec: InputSpec) -> torch.Tensor:
    """Images (uint8 0..255, or floats in the value range; HW, HWC or CHW) -> float32 CPU
    tensor [N, C, H, W] in ``spec``. Channels are converted (RGB -> gray by luma, gray -> RGB by
    repetition, alpha dropped) and other sizes resized by the spec's policy (:func:`resize`)
    unless the spec is strict, which refuses any other shape. A numpy array is a stack of images
    along its first axis."""
    if isinstance(images, np.ndarray):
        if images.ndim not in (3, 4):
            raise InputError(
                f"an array of images must be [N, H, W] or [N, H, W, C] / [N, C, H, W], got shape {images.shape}; "
                "wrap a single image in a list"
            )
        stacked = prepare_stack(images, spec)
        if stacked is not None:
            return stacked
        images = list(images)
    if len(images) == 0:
        raise InputError("no images given")
    return torch.stack([prepare_one(np.asarray(image), spec, i) for i, image in enumerate(images)])


def prepare_stack(images: np.ndarray, spec: InputSpec) -> torch.Tensor | None:
    """The whole stack at once when it already has the spec's size and channels (NCHW, NHWC,
    or NHW for one channel) and valid pixels; None sends it through the per-image path, which
    converts what needs converting and names the image at fault."""
    if images.ndim == 4 and images.shape[1:] == spec.shape:
        chw = images
    elif images.ndim == 4 and images.shape[1:] == (spec.height, spec.width, spec.channels):
        chw = images.transpose(0, 3, 1, 2)
    elif images.ndim == 3 and spec.channels == 1 and images.shape[1:] == (spec.height, spec.width):
        chw = images[:, None]
    else:
        return None
    low, high = spec.value_range
    if images.dtype == np.uint8:
        return scale_uint8(chw, spec.value_range)
    if not np.issubdtype(images.dtype, np.floating):
        return None
    x = torch.from_numpy(np.ascontiguousarray(chw, dtype=np.float32))
    slack = 1e-3 * (high - low)
    if not torch.isfinite(x).all() or x.min() < low - slack or x.max() > high + slack:
        return None
    return x.clamp(low, high)


def prepare_one(image: np.ndarray, spec: InputSpec, index: int) -> torch.Tensor:
    """One image -> [C, H, W] in ``spec``; ``index`` names it in errors."""
    x = _pixels(image, spec.value_range, index)
    x = to_chw(x, spec, index)
    if x.shape == spec.shape:
        return x
    if 0 in x.shape:
        raise InputError(
            f"image {index} is empty: shape {'x'.join(map(str, x.shape))} "
            "(channels x height x width) has no pixels"
        )
    if spec.resize == "strict":
        raise InputError(
            f"image {index} has shape {'x'.join(map(str, x.shape))} (channels x height x width); "
            f"this model takes exactly {'x'.join(map(str, spec.shape))} and its input spec is strict"
        )
    x = convert_channels(x, spec.channels, index)
    if x.shape[1:] != (spec.height, spec.width):
        x = resize(x, spec)
    return x


def resize(x: torch.Tensor, spec: InputSpec) -> torch.Tensor:
    """CHW of any size -> CHW of the spec's size, by its policy: the shorter side to
    ``resize_to`` (aspect kept) then the centre, as torchvision's ``Resize`` + ``CenterCrop``,
    or without a crop a stretch to (height, width). Antialiased; clamped to the value range."""
    if spec.crop == "center" and spec.resize_to is not None:
        x = _interpolate(x, shorter_side_size(x.shape[1], x.shape[2], spec.resize_to), spec)
        return center_crop(x, spec.height, spec.width)
    return _interpolate(x, (spec.height, spec.width), spec)


def shorter_side_size(height: int, width: int, shorter: int) -> tuple[int, int]:
    """(height, width) with the shorter side ``shorter`` and the aspect ratio kept, rounded as
    torchvision's ``Resize(int)`` rounds (the longer side truncated)."""
    if height <= width:
        return shorter, int(shorter * width / height)
    return int(shorter * height / width), shorter


def center_crop(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The centre ``height`` x ``width`` of CHW ``x`` (at least that large), offsets rounded as
    torchvision's ``CenterCrop``."""
    top = int(round((x.shape[1] - height) / 2.0))
    left = int(round((x.shape[2] - width) / 2.0))
    return x[:, top : top + height, left : left + width]


def _interpolate(x: torch.Tensor, size: tuple[int, int], spec: InputSpec) -> torch.Tensor:
    if tuple(x.shape[1:]) == size:
        return x
    low, high = spec.value_range
    return F.interpolate(
        x.unsqueeze(0),
        size=size,
        mode=spec.interpolation or "bilinear",
        antialias=True,
        align_corners=False,
    )[0].clamp(low, high)


def _pixels(image: np.ndarray, value_range: tuple[float, float], index: int) -> torch.Tensor:
    """uint8 scaled to ``value_range``, or floats checked to lie in it (to a small slack)."""
    low, high = value_range
    if image.dtype == np.uint8:
        return scale_uint8(image, value_range)
    if not np.issubdtype(image.dtype, np.floating):
        raise InputError(f"image {index}: unsupported pixel type {image.dtype}; use uint8 or float")
    x = torch.from_numpy(image.astype(np.float32))
    if not torch.isfinite(x).all():
        raise InputError(f"image {index} contains NaN or infinite values")
    slack = 1e-3 * (high - low)
    if x.numel() and (x.min() < low - slack or x.max() > high + slack):
        raise InputError(
            f"image {index}: float pixels must lie in the value range [{low}, {high}], got "
            f"[{x.min().item():.4g}, {x.max().item():.4g}]; send uint8 (0..255) or scale the floats"
        )
    return x.clamp(low, high)


def to_chw(x: torch.Tensor, spec: InputSpec, index: int) -> torch.Tensor:
    """HW, HWC or CHW -> CHW (an exact match of the spec's CHW shape is kept as it is)."""
    if x.ndim == 2:
        return x.unsqueeze(0)
    if x.ndim != 3:
        raise InputError(f"image {index} must be HW, HWC or CHW, got {x.ndim} dimensions")
    if x.shape[0] == spec.channels and tuple(x.shape[1:]) == (spec.height, spec.width):
        return x
    if x.shape[2] in (1, 2, 3, 4):
        return x.permute(2, 0, 1)
    if x.shape[0] in (1, 2, 3, 4):
        return x
    raise InputError(
        f"image {index} with shape {tuple(x.shape)} has no channel axis of 1 to 4 channels"
    )


def convert_channels(x: torch.Tensor, target: int, index: int) -> torch.Tensor:
    """CHW with 1 to 4 channels -> ``target`` channels (alpha dropped, luma, repetition)."""
    channels = x.shape[0]
    if channels == target:
        return x
    if channels in (2, 4):  # drop alpha
        x, channels = x[: channels - 1], channels - 1
    if channels == target:
        return x
    if channels == 3 and target == 1:
        luma = torch.tensor(LUMA, dtype=x.dtype).view(3, 1, 1)
        return (x * luma).sum(dim=0, keepdim=True)
    if channels == 1 and target == 3:
        return x.expand(3, -1, -1).contiguous()
    raise InputError(f"image {index}: cannot convert {channels} channel(s) to the model's {target}")
