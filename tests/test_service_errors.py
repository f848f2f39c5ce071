"""Error answers on a live server: each bad request gets its HTTP status and error body, unknown
routes and methods use the same shape, and the server keeps answering afterwards."""

from __future__ import annotations

import pytest

from tests.service_helpers import (
    INFERENCE_PATHS,
    decompression_bomb,
    error_code,
    error_message,
    ico_image,
    many_parts,
    upload,
    v2_request,
)

V1_PATHS = INFERENCE_PATHS[:2]
V2_INFER = INFERENCE_PATHS[2]
JSON = {"Content-Type": "application/json"}

ERROR_CASES = {
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
    "empty BYTES batch": (
        "/v2/models/tiny/infer",
        lambda im: {
            "json": {"inputs": [{"name": "image", "shape": [0], "datatype": "BYTES", "data": []}]}
        },
        400,
        "invalid_input",
    ),
    "zero-sized tensor image": (
        "/v2/models/tiny/infer",
        lambda im: v2_request([1, 1, 0, 0], 0),
        400,
        "invalid_input",
    ),
    "number too large for JSON data": (
        "/v2/models/tiny/infer",
        lambda im: {
            "content": b'{"inputs": [{"name": "input", "shape": [1], "datatype": "FP32", "data": [1'
            + b"0" * 400
            + b"]}]}",
            "headers": JSON,
        },
        400,
        "invalid_input",
    ),
    "dimension too large": (
        "/v2/models/tiny/infer",
        lambda im: v2_request([0, 2**63], 0),
        413,
        "payload_too_large",
    ),
    "dimensions too large together": (
        "/v2/models/tiny/infer",
        lambda im: v2_request([0, 2**30, 2**30, 2**30], 0),
        400,
        "invalid_input",
    ),
    "strings as numbers": (
        "/v2/models/tiny/infer",
        lambda im: {
            "json": {
                "inputs": [
                    {"name": "input", "shape": [1, 1, 1, 1], "datatype": "FP32", "data": ["0.5"]}
                ]
            }
        },
        400,
        "invalid_input",
    ),
    "shape as strings": (
        "/v2/models/tiny/infer",
        lambda im: {
            "json": {
                "inputs": [{"name": "input", "shape": ["1"], "datatype": "FP32", "data": [0.5]}]
            }
        },
        422,
        "validation_error",
    ),
    "binary_data_output as a string": (
        "/v2/models/tiny/infer",
        lambda im: {
            "json": v2_request([1, 1, 28, 28], 784)["json"]
            | {"parameters": {"binary_data_output": "false"}}
        },
        400,
        "invalid_input",
    ),
    "header length as a non-ASCII digit": (
        "/v2/models/tiny/infer",
        lambda im: {
            "content": b'{"inputs": []}',
            "headers": {"Inference-Header-Content-Length": b"\xb2", **JSON},
        },
        400,
        "invalid_input",
    ),
    "unknown model": (
        "/v2/models/other/infer",
        lambda im: v2_request([1, 1, 28, 28], 784),
        404,
        "model_not_found",
    ),
}

#: Hostile requests a schema cannot express, sent to each route in ``paths``: name: (request to
#: a path, status, code, paths).
HOSTILE = {
    "decompression bomb": (
        lambda path, im: upload(path, [decompression_bomb()]),
        413,
        "payload_too_large",
        INFERENCE_PATHS,
    ),
    "truncated png": (
        lambda path, im: upload(path, [im[0][: len(im[0]) // 2]]),
        400,
        "invalid_input",
        INFERENCE_PATHS,
    ),
    "0-byte file": (lambda path, im: upload(path, [b""]), 400, "invalid_input", INFERENCE_PATHS),
    "0-byte body": (
        lambda path, im: {"content": b"", "headers": JSON},
        422,
        "validation_error",
        INFERENCE_PATHS,
    ),
    "body too large": (
        lambda path, im: {"content": b"x" * 250_000, "headers": JSON},
        413,
        "payload_too_large",
        INFERENCE_PATHS,
    ),
    "chunked body too large": (  # no Content-Length: refused while the body streams in
        lambda path, im: {"content": iter([b"x" * 60_000] * 5), "headers": JSON},
        413,
        "payload_too_large",
        INFERENCE_PATHS,
    ),
    "body type": (
        lambda path, im: {"content": im[0], "headers": {"Content-Type": "image/png"}},
        415,
        "unsupported_media_type",
        V1_PATHS,
    ),
    "thousands of file parts": (
        lambda path, im: many_parts(2000, files=True),
        413,
        "payload_too_large",
        V1_PATHS,
    ),
    "thousands of text fields": (
        lambda path, im: many_parts(3000, files=False),
        400,
        "invalid_input",
        V1_PATHS,
    ),
    # v2 reads its body as JSON (or the binary extension) whatever its declared type
    "image as the body": (
        lambda path, im: {"content": im[0], "headers": {"Content-Type": "image/png"}},
        422,
        "validation_error",
        (V2_INFER,),
    ),
    "thousands of tensor images": (
        lambda path, im: upload(path, [b""] * 5000),
        413,
        "payload_too_large",
        (V2_INFER,),
    ),
}
ERROR_CASES.update(
    {
        f"{name} {path}": (path, lambda im, make=make, path=path: make(path, im), status, code)
        for name, (make, status, code, paths) in HOSTILE.items()
        for path in paths
    }
)


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
