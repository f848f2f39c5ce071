"""Image decoding (`detector.images`, shared by the service and batch scoring): modes, bit depths,
and refusals before any pixel is decoded."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from detector.images import decode_image, image_pixels
from tests.service_helpers import decompression_bomb, encode, ico_image


@pytest.mark.parametrize(
    ("mode", "keep_alpha", "shape"),
    [("L", False, (9, 7)), ("RGB", False, (9, 7, 3)), ("RGBA", False, (9, 7, 3)), ("RGBA", True, (9, 7, 4)),
     ("I;16", False, (9, 7)), ("1", False, (9, 7)), ("P", False, (9, 7, 3))],
)  # fmt: skip
def test_decode_image_modes(mode: str, keep_alpha: bool, shape: tuple[int, ...]) -> None:
    image = Image.new(mode, (7, 9))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    array = decode_image(buffer.getvalue(), max_pixels=100, keep_alpha=keep_alpha)
    assert array.shape == shape and array.dtype == np.uint8


def test_decode_image_16_bit_is_scaled_not_clipped() -> None:
    buffer = io.BytesIO()
    Image.fromarray(np.full((4, 4), 65535, np.uint16)).save(buffer, "PNG")
    assert decode_image(buffer.getvalue(), max_pixels=100).max() == 255


def test_decode_image_refuses_before_decoding() -> None:
    from detector.errors import InputError, InputTooLargeError, UnsupportedMediaError

    with pytest.raises(InputTooLargeError, match="more than the limit"):
        decode_image(decompression_bomb(), max_pixels=512 * 512)
    with pytest.raises(UnsupportedMediaError, match="ICO"):
        decode_image(ico_image(), max_pixels=10_000)
    with pytest.raises(UnsupportedMediaError, match="JPEG is not accepted"):
        decode_image(encode(np.zeros((4, 4), np.uint8), "JPEG"), max_pixels=100, formats=("PNG",))
    noise = np.random.default_rng(0).integers(0, 256, (40, 40), dtype=np.uint8)
    for bad in (b"", b"not an image", encode(noise)[:300]):
        with pytest.raises(InputError):
            decode_image(bad, max_pixels=10_000)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "BMP"])
@pytest.mark.parametrize("shape", [(28, 28), (5, 300), (233, 300, 3)])
def test_image_pixels_reads_the_header(fmt: str, shape: tuple[int, ...]) -> None:
    """PNG sizes come from the IHDR bytes, the others from Pillow: both give width x height."""
    assert image_pixels(encode(np.zeros(shape, np.uint8), fmt)) == shape[0] * shape[1]


def test_image_pixels_of_what_is_not_an_image_is_zero() -> None:
    png = encode(np.zeros((4, 4), np.uint8), "PNG")
    for data in (b"", png[:8], png[:20], b"not an image at all"):
        assert image_pixels(data) == 0
