"""Error answers on a live server: each bad request gets its HTTP status and error body, unknown
routes and methods use the same shape, and the server keeps answering afterwards."""

from __future__ import annotations

import pytest

from tests.service_helpers import (
    decompression_bomb,
    error_code,
    error_message,
    ico_image,
    v2_request,
)

ERROR_CASES = {
    "corrupt image": (
        "/v1/predict",
        lambda im: {"files": {"files": ("a.png", im[0][:80], "image/png")}},
        400,
        "invalid_input",
    ),
    "not an image": (
        "/v1/predict",
        lambda im: {"files": {"files": ("a.bin", b"hello world", "application/octet-stream")}},
        400,
        "invalid_input",
    ),
    "bad base64": (
        "/v1/predict",
        lambda im: {"json": {"instances": [{"b64": "%%%"}]}},
        400,
        "invalid_input",
    ),
    "text part": (
        "/v1/predict",
        lambda im: {"files": {"files": ("a.txt", b"hello", "text/plain")}},
        415,
        "unsupported_media_type",
    ),
    "ico format": (
        "/v1/predict",
        lambda im: {"files": {"files": ("a.ico", ico_image(), "image/x-icon")}},
        415,
        "unsupported_media_type",
    ),
    "body type": (
        "/v1/predict",
        lambda im: {"content": b"abc", "headers": {"Content-Type": "text/plain"}},
        415,
        "unsupported_media_type",
    ),
    "too many images": (
        "/v1/predict",
        lambda im: {"files": [("files", ("a.png", im[0], "image/png"))] * 9},
        413,
        "payload_too_large",
    ),
    "too many instances": (
        "/v1/predict",
        lambda im: {"json": {"instances": [{"b64": "AA=="}] * 9}},
        413,
        "payload_too_large",
    ),
    "body too large": (
        "/v1/predict",
        lambda im: {"content": b"x" * 250_000, "headers": {"Content-Type": "application/json"}},
        413,
        "payload_too_large",
    ),
    "chunked body too large": (
        "/v1/predict",
        lambda im: {
            "content": iter([b"x" * 60_000] * 5),
            "headers": {"Content-Type": "application/json"},
        },
        413,
        "payload_too_large",
    ),
    "decompression bomb": (
        "/v1/predict",
        lambda im: {"files": {"files": ("bomb.png", decompression_bomb(), "image/png")}},
        413,
        "payload_too_large",
    ),
    "schema": (
        "/v1/predict",
        lambda im: {"json": {"instances": [{"url": "http://x"}]}},
        422,
        "validation_error",
    ),
    "invalid json": (
        "/v1/predict",
        lambda im: {"content": b"{", "headers": {"Content-Type": "application/json"}},
        422,
        "validation_error",
    ),
    "no files field": (
        "/v1/predict",
        lambda im: {"data": {"x": "1"}, "files": {"other": ("a.png", im[0], "image/png")}},
        422,
        "validation_error",
    ),
    "wrong tensor rank": (
        "/v2/models/tiny/infer",
        lambda im: v2_request([2, 28, 28], 2 * 784),
        400,
        "invalid_input",
    ),
    "wrong tensor channels": (
        "/v2/models/tiny/infer",
        lambda im: v2_request([1, 5, 28, 28], 5 * 784),
        400,
        "invalid_input",
    ),
    "shape and data disagree": (
        "/v2/models/tiny/infer",
        lambda im: v2_request([1, 1, 28, 28], 700),
        400,
        "invalid_input",
    ),
    "too many tensor images": (
        "/v2/models/tiny/infer",
        lambda im: v2_request([9, 1, 2, 2], 36),
        413,
        "payload_too_large",
    ),
    "v2 schema": (
        "/v2/models/tiny/infer",
        lambda im: {"json": {"inputs": [{"name": "input"}]}},
        422,
        "validation_error",
    ),
    "unknown model": (
        "/v2/models/other/infer",
        lambda im: v2_request([1, 1, 28, 28], 784),
        404,
        "model_not_found",
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_answers_its_code_and_the_server_keeps_answering(client, images, case: str) -> None:
    path, request, status, code = ERROR_CASES[case]
    response = client.post(path, **request(images))
    assert response.status_code == status, response.text
    assert error_code(response) == code and error_message(response)
    assert response.headers["x-request-id"]
    after = client.post("/v1/predict", files={"files": ("a.png", images[0], "image/png")})
    assert after.status_code == 200 and client.get("/readyz").status_code == 200


def test_unknown_route_and_method_use_the_error_shape(client) -> None:
    missing = client.get("/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = client.get("/v1/predict")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
