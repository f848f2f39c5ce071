"""Decoding untrusted encoded images (PNG, JPEG, ...) into uint8 arrays, safely.

The one decoder the service and batch scoring share. It reads the header first and refuses an
image whose format is not accepted or whose pixel count exceeds ``max_pixels`` BEFORE any pixel
data is decompressed (decompression bombs), then decodes the first frame and normalizes the mode:
grayscale images come back as ``HxW`` and colour images as ``HxWx3`` (``HxWx4`` with
``keep_alpha``), always ``uint8``. Resizing and channel conversion to a network's input spec are
not done here (that is :meth:`detector.guard.Guard.prepare`).
"""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from detector.errors import InputError, InputTooLargeError, UnsupportedMediaError

#: Formats accepted by default (Pillow format names).
DEFAULT_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "BMP", "GIF", "TIFF", "WEBP")

#: Default pixel limit per image (width x height), the same order as Pillow's own bomb guard.
DEFAULT_MAX_PIXELS = 4096 * 4096

_GRAY_MODES = {"1", "L", "LA", "La"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_WIDE_GRAY_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N", "F"}
_ALPHA_MODES = {"RGBA", "RGBa", "PA"}


def decode_image(
    data: bytes,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    formats: Sequence[str] = DEFAULT_FORMATS,
    keep_alpha: bool = False,
) -> np.ndarray:
    """Decode one encoded image into a ``uint8`` array: ``HxW`` (grayscale) or ``HxWxC``.

    Raises :class:`UnsupportedMediaError` for a format outside ``formats``,
    :class:`InputTooLargeError` for more than ``max_pixels`` pixels (checked from the header,
    before decoding), and :class:`InputError` for empty, corrupt or truncated data.
    """
    if not data:
        raise InputError("empty image: the upload holds no bytes")
    accepted = [f.upper() for f in formats]
    image = _open(data, accepted)
    try:
        width, height = image.size
        if width <= 0 or height <= 0:
            raise InputError(f"invalid image size {width}x{height}")
        if width * height > max_pixels:
            raise InputTooLargeError(
                f"image is {width}x{height} = {width * height} pixels, more than the limit of "
                f"{max_pixels}; send a smaller image"
            )
        try:
            image.seek(0)
            image.load()
        except MemoryError:
            raise
        except (
            Exception
        ) as error:  # Pillow raises many types for corrupt data (OSError, SyntaxError, ...)
            raise InputError(
                f"cannot decode {image.format} image (corrupt or truncated): {error}"
            ) from error
        return _to_uint8(image, keep_alpha=keep_alpha)
    finally:
        image.close()


def image_pixels(data: bytes) -> int:
    """Width x height from the header alone (0 when the data is not a recognisable image).

    A PNG's size is read from its IHDR chunk directly (microseconds: the service calls this for
    every image of every request); other formats go through Pillow's header parser."""
    if data[:8] == _PNG_SIGNATURE and data[12:16] == b"IHDR" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return int(width) * int(height)
    try:
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
            return int(width) * int(height)
    except Exception:  # not an image we can read the header of: decode_image will say why
        return 0


def readable_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """``formats`` upper-cased, checked to be image formats Pillow can open (ValueError names
    the unknown ones and the known ones); at least one."""
    accepted = tuple(f.upper() for f in formats)
    if not accepted:
        raise ValueError("accept at least one image format")
    Image.init()
    unknown = [f for f in accepted if f not in Image.OPEN]
    if unknown:
        raise ValueError(
            f"unknown image format(s) {', '.join(unknown)}: Pillow opens "
            f"{', '.join(sorted(Image.OPEN))}"
        )
    return accepted


def _open(data: bytes, accepted: list[str]) -> Image.Image:
    """Open (header only) with the accepted formats' plugins; name the format when refused."""
    try:
        return Image.open(io.BytesIO(data), formats=accepted)
    except Image.DecompressionBombError as error:
        raise InputTooLargeError(f"image refused as a decompression bomb: {error}") from error
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        detected = _detect_format(data)
        if detected is not None and detected not in accepted:
            raise UnsupportedMediaError(
                f"image format {detected} is not accepted; send one of {', '.join(accepted)}"
            ) from error
        raise InputError(
            f"cannot decode the data as an image ({', '.join(accepted)}): corrupt, truncated or not an image"
        ) from error


def _detect_format(data: bytes) -> str | None:
    """The format Pillow recognises from the header, without decoding pixels (None if none)."""
    try:
        with Image.open(io.BytesIO(data)) as probe:
            return probe.format
    except Exception:  # any failure means: not an image we can name
        return None


def _to_uint8(image: Image.Image, *, keep_alpha: bool) -> np.ndarray:
    mode = image.mode
    if mode in _GRAY_MODES:
        array = np.asarray(image.convert("L"))
    elif mode in _WIDE_GRAY_MODES:
        array = _scale_wide(np.asarray(image), mode)
    elif keep_alpha and (mode in _ALPHA_MODES or (mode == "P" and "transparency" in image.info)):
        array = np.asarray(image.convert("RGBA"))
    else:
        array = np.asarray(image.convert("RGB"))
    return np.ascontiguousarray(array, dtype=np.uint8)


def _scale_wide(array: np.ndarray, mode: str) -> np.ndarray:
    """16-bit, 32-bit integer or float grayscale to 8 bits (floats taken as [0, 1] when they fit)."""
    values = array.astype(np.float64)
    if mode == "F":
        if values.size and np.nanmax(values) <= 1.0:
            values = values * 255.0
        return np.clip(np.nan_to_num(values), 0, 255).round().astype(np.uint8)
    return (np.clip(values, 0, 65535) / 257.0).round().astype(np.uint8)
