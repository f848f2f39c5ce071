"""The v2 routes (Open Inference Protocol / KServe) on a live server: metadata, JSON and binary
tensors, encoded images as BYTES, and a stock KServe v2 client."""

from __future__ import annotations

import base64
import json
import struct

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.service_helpers import API_KEY, expected, synthetic_images


def test_v2_metadata_and_health(client) -> None:
    assert client.get("/v2").json()["extensions"] == ["binary_tensor_data"]
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}
    assert client.get("/v2/models/tiny/ready").status_code == 200
    metadata = client.get("/v2/models/tiny").json()
    assert metadata["versions"] == ["7"]
    assert metadata["inputs"][0] == {
        "name": "input",
        "datatype": "FP32",
        "shape": [-1, 1, 28, 28],
        "parameters": {"value_range": [0.0, 1.0], "alternative_to": "image"},
    }
    assert [o["name"] for o in metadata["outputs"]] == [
        "probabilities",
        "label",
        "flagged",
        "score",
        "query_attack",
    ]


def test_v2_infer_json_fp32(client, guard) -> None:
    x = synthetic_images(3, seed=5)
    request = {
        "id": "r1",
        "inputs": [
            {
                "name": "input",
                "shape": list(x.shape),
                "datatype": "FP32",
                "data": x.reshape(-1).tolist(),
            }
        ],
    }
    response = client.post("/v2/models/tiny/infer", json=request)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model_name"] == "tiny" and body["model_version"] == "7" and body["id"] == "r1"
    outputs = {o["name"]: o for o in body["outputs"]}
    reference = guard.predict(x)
    assert (
        outputs["label"]["datatype"] == "INT64"
        and outputs["label"]["data"] == reference.labels.tolist()
    )
    assert (
        outputs["flagged"]["datatype"] == "BOOL"
        and outputs["flagged"]["data"] == reference.flagged.tolist()
    )
    assert outputs["probabilities"]["shape"] == [3, 10]
    np.testing.assert_allclose(
        np.reshape(outputs["probabilities"]["data"], (3, 10)), reference.probabilities, atol=1e-5
    )
    np.testing.assert_allclose(outputs["score"]["data"], reference.scores, atol=1e-5)


def test_v2_infer_binary_extension_by_hand(client, guard) -> None:
    """Exactly what a v2 client sends: JSON header + raw little-endian tensor bytes."""
    x = synthetic_images(2, seed=6)
    raw = x.astype("<f4").tobytes()
    header = {
        "inputs": [
            {
                "name": "input",
                "shape": [2, 1, 28, 28],
                "datatype": "FP32",
                "parameters": {"binary_data_size": len(raw)},
            }
        ],
        "outputs": [
            {"name": "label", "parameters": {"binary_data": True}},
            {"name": "score", "parameters": {"binary_data": False}},
        ],
    }
    head = json.dumps(header).encode()
    response = client.post(
        "/v2/models/tiny/versions/7/infer",
        content=head + raw,
        headers={
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        },
    )
    assert response.status_code == 200, response.text
    length = int(response.headers["inference-header-content-length"])
    body = json.loads(response.content[:length])
    label, score = body["outputs"]
    assert label["parameters"]["binary_data_size"] == 16 and "data" not in label
    reference = guard.predict(x)
    assert np.frombuffer(response.content[length:], "<i8").tolist() == reference.labels.tolist()
    np.testing.assert_allclose(score["data"], reference.scores, atol=1e-5)


def test_v2_bytes_images_json_and_binary(client, guard, images) -> None:
    reference = expected(guard, images[:2])
    as_json = {
        "inputs": [
            {
                "name": "image",
                "shape": [2],
                "datatype": "BYTES",
                "data": [base64.b64encode(b).decode() for b in images[:2]],
            }
        ]
    }
    response = client.post("/v2/models/tiny/infer", json=as_json)
    assert response.status_code == 200, response.text
    assert {o["name"]: o["data"] for o in response.json()["outputs"]}[
        "label"
    ] == reference.labels.tolist()
    raw = b"".join(struct.pack("<I", len(b)) + b for b in images[:2])
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [2],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ]
        }
    ).encode()
    response = client.post(
        "/v2/models/tiny/infer",
        content=head + raw,
        headers={"Inference-Header-Content-Length": str(len(head))},
    )
    assert response.status_code == 200, response.text
    assert {o["name"]: o["data"] for o in response.json()["outputs"]}[
        "flagged"
    ] == reference.flagged.tolist()


def test_v2_with_the_stock_kserve_triton_client(server, guard, images) -> None:
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    headers = {"X-API-Key": API_KEY}
    try:
        assert (
            client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
        )
        assert client.get_model_metadata("tiny")["name"] == "tiny"
        x = synthetic_images(4, seed=7)
        for binary in (True, False):
            tensor = httpclient.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            outputs = [
                httpclient.InferRequestedOutput(n, binary_data=binary)
                for n in ("probabilities", "label", "flagged", "score", "query_attack")
            ]
            # a fresh dict per call: the client writes Inference-Header-Content-Length into it
            result = client.infer("tiny", [tensor], outputs=outputs, headers=dict(headers))
            reference = guard.predict(x)
            assert result.as_numpy("label").tolist() == reference.labels.tolist()
            assert result.as_numpy("flagged").tolist() == reference.flagged.tolist()
            assert result.as_numpy("query_attack").tolist() == [False] * 4
            np.testing.assert_allclose(
                result.as_numpy("probabilities"), reference.probabilities, atol=1e-5
            )
            np.testing.assert_allclose(result.as_numpy("score"), reference.scores, atol=1e-5)
        encoded = httpclient.InferInput("image", [3], "BYTES")
        encoded.set_data_from_numpy(np.array(images[:3], dtype=np.object_), binary_data=True)
        result = client.infer(
            "tiny", [encoded], headers=dict(headers)
        )  # no outputs named: all, binary
        assert result.as_numpy("label").tolist() == expected(guard, images[:3]).labels.tolist()
        # errors reach the stock client as readable text, as the protocol shapes them
        wrong = httpclient.InferInput("input", [1, 5, 28, 28], "FP32")
        wrong.set_data_from_numpy(np.zeros((1, 5, 28, 28), np.float32), binary_data=True)
        with pytest.raises(httpclient.InferenceServerException) as raised:
            client.infer("tiny", [wrong], headers=dict(headers))
        assert raised.value.status() == "400" and "channel" in raised.value.message()
    finally:
        client.close()
