"""The gRPC Open Inference Protocol endpoint on a live server, with tritonclient's stock gRPC
client and raw protocol messages: health and metadata; FP32 and BYTES inference answering as
REST does; malformed requests refused with a status code, the server staying up; the API key,
the query memory and the metrics shared with REST; `lapguard serve --grpc-port`."""

from __future__ import annotations

import base64
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from service.settings import Settings
from tests.live_server import LiveServer
from tests.service_helpers import (
    API_KEY,
    decompression_bomb,
    encode,
    ico_image,
    near_duplicates,
    server_settings,
    synthetic_images,
)
from tests.test_service_cli import ROOT, _serve
from tests.test_service_lifecycle import HeldWarmup

MODEL = "tiny"
KEY = {"x-api-key": API_KEY}
OUTPUTS = ("probabilities", "label", "flagged", "score")


@pytest.fixture(scope="module")
def live(service_bundle) -> Iterator[LiveServer]:
    """The conftest server's settings (API key, small limits), with gRPC on a free port."""
    settings = server_settings(service_bundle, grpc_port=0)
    with LiveServer(settings) as server:
        yield server


def _target(server: LiveServer) -> str:
    return f"127.0.0.1:{server.app.state.grpc.port}"


@pytest.fixture(scope="module")
def client(live) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(_target(live)) as c:
        yield c


@pytest.fixture(scope="module")
def stub(live) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    """Raw protocol messages, for requests a stock client would never send."""
    with grpc.insecure_channel(_target(live)) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _status(error: InferenceServerException) -> str:
    return str(error.status()).removeprefix("StatusCode.")


# ---- health and metadata ------------------------------------------------------------------------
def test_health_and_metadata(client) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "7")
    server = client.get_server_metadata(as_json=True)
    assert server["name"] == "lapguard" and server["version"]
    model = client.get_model_metadata(MODEL, as_json=True)
    assert model["name"] == MODEL and model["versions"] == ["7"] and model["platform"] == "lapguard"
    inputs = {t["name"]: (t["datatype"], t["shape"]) for t in model["inputs"]}
    assert inputs == {"input": ("FP32", ["-1", "1", "28", "28"]), "image": ("BYTES", ["-1"])}
    outputs = [t["name"] for t in model["outputs"]]
    assert outputs == [*OUTPUTS, "query_attack"]
    for call in (
        lambda: client.is_model_ready("other"),
        lambda: client.get_model_metadata(MODEL, "6"),
    ):
        with pytest.raises(InferenceServerException) as refused:
            call()
        assert _status(refused.value) == "NOT_FOUND"


def test_triton_only_calls_answer_unimplemented(client) -> None:
    for call in (client.get_model_config, client.get_inference_statistics):
        with pytest.raises(InferenceServerException) as refused:
            call(MODEL)
        assert _status(refused.value) == "UNIMPLEMENTED"
    assert client.is_server_live()


# ---- inference: the same answers as REST --------------------------------------------------------
def _grpc_answer(client, name: str, array: np.ndarray, datatype: str) -> dict[str, np.ndarray]:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    result = client.infer(MODEL, [tensor], headers=KEY)
    answer = {name: result.as_numpy(name) for name in OUTPUTS}
    response = result.get_response()
    assert response.model_name == MODEL and response.model_version == "7"
    answer["threshold"] = np.float32(response.parameters["threshold"].double_param)
    return answer


def _rest_answer(live, tensor: dict) -> dict[str, np.ndarray]:
    response = httpx.post(
        f"{live.url}/v2/models/{MODEL}/infer",
        json={"inputs": [tensor]},
        headers={"X-API-Key": API_KEY},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    answer = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in body["outputs"]}
    answer["threshold"] = np.float32(body["parameters"]["threshold"])
    return answer


def _assert_same(grpc_answer: dict, rest_answer: dict) -> None:
    assert grpc_answer["label"].tolist() == rest_answer["label"].tolist()
    assert grpc_answer["flagged"].tolist() == rest_answer["flagged"].tolist()
    np.testing.assert_allclose(grpc_answer["score"], rest_answer["score"], atol=1e-6)
    np.testing.assert_allclose(
        grpc_answer["probabilities"], rest_answer["probabilities"], atol=1e-6
    )
    assert grpc_answer["threshold"] == pytest.approx(rest_answer["threshold"])


def test_fp32_inputs_answer_as_rest(live, client) -> None:
    array = synthetic_images(5, seed=11)
    tensor = {"name": "input", "shape": list(array.shape), "datatype": "FP32"}
    rest = _rest_answer(live, {**tensor, "data": array.reshape(-1).tolist()})
    _assert_same(_grpc_answer(client, "input", array, "FP32"), rest)


def test_bytes_inputs_answer_as_rest(live, client, images) -> None:
    """PNG, JPEG, a large PNG (decoded in a worker thread) and a GIF, in one request."""
    blobs = np.array(images, dtype=np.object_)
    tensor = {"name": "image", "shape": [len(images)], "datatype": "BYTES"}
    rest = _rest_answer(live, {**tensor, "data": [base64.b64encode(b).decode() for b in images]})
    _assert_same(_grpc_answer(client, "image", blobs, "BYTES"), rest)


def _request(datatype: str, shape: list[int], **contents) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL, id="r-1")
    request.inputs.add(
        name="x", datatype=datatype, shape=shape, contents=pb.InferTensorContents(**contents)
    )
    return request


def test_typed_contents_answer_as_raw_input_contents(live, client, stub, images) -> None:
    """The protocol's typed ``contents`` (what a hand-written client sends) answer as raw bytes."""
    array = synthetic_images(2, seed=12)
    typed = stub.ModelInfer(
        _request("FP32", list(array.shape), fp32_contents=array.reshape(-1).tolist()),
        metadata=tuple(KEY.items()),
        timeout=60,
    )
    assert typed.id == "r-1" and [o.name for o in typed.outputs] == [*OUTPUTS, "query_attack"]
    labels = np.frombuffer(typed.raw_output_contents[1], dtype="<i8")
    scores = np.frombuffer(typed.raw_output_contents[3], dtype="<f4")
    raw = _grpc_answer(client, "input", array, "FP32")
    assert labels.tolist() == raw["label"].tolist()
    np.testing.assert_allclose(scores, raw["score"], atol=1e-6)
    encoded = stub.ModelInfer(
        _request("BYTES", [2], bytes_contents=images[:2]), metadata=tuple(KEY.items())
    )
    assert np.frombuffer(encoded.raw_output_contents[2], dtype=bool).shape == (2,)


def test_requested_outputs_are_answered_in_order(client) -> None:
    tensor = triton.InferInput("input", [1, 1, 28, 28], "FP32")
    tensor.set_data_from_numpy(synthetic_images(1, seed=13))
    wanted = [triton.InferRequestedOutput("score"), triton.InferRequestedOutput("label")]
    result = client.infer(MODEL, [tensor], outputs=wanted, headers=KEY)
    assert [o.name for o in result.get_response().outputs] == ["score", "label"]


# ---- malformed requests -------------------------------------------------------------------------
def _fp32(shape: list[int], values: np.ndarray | None = None) -> pb.ModelInferRequest:
    """An FP32 request in raw_input_contents (``values`` default: 0.5s of ``shape``)."""
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="input", datatype="FP32", shape=shape)
    data = np.full(shape, 0.5, "<f4") if values is None else values
    request.raw_input_contents.append(np.asarray(data, "<f4").tobytes())
    return request


def _images(*blobs: bytes, shape: list[int] | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="image", datatype="BYTES", shape=shape or [len(blobs)])
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(b)) + b for b in blobs))
    return request


def _edit(request: pb.ModelInferRequest, change: Callable[[pb.ModelInferRequest], object]):
    change(request)
    return request


GOOD = [1, 1, 28, 28]
MALFORMED: dict[str, tuple[Callable[[], pb.ModelInferRequest], str]] = {
    "no inputs": (lambda: pb.ModelInferRequest(model_name=MODEL), "INVALID_ARGUMENT"),
    "two inputs": (
        lambda: _edit(
            _fp32(GOOD),
            lambda r: (
                r.inputs.append(r.inputs[0]),
                r.raw_input_contents.append(r.raw_input_contents[0]),
            ),
        ),
        "INVALID_ARGUMENT",
    ),
    "unknown datatype": (lambda: _request("FP8", GOOD), "INVALID_ARGUMENT"),
    "integer datatype": (lambda: _request("INT32", [1], int_contents=[1]), "INVALID_ARGUMENT"),
    "3-d tensor": (lambda: _fp32([1, 28, 28]), "INVALID_ARGUMENT"),
    "5-d tensor": (lambda: _fp32([1, 1, 1, 28, 28]), "INVALID_ARGUMENT"),
    "too few values": (
        lambda: _request("FP32", GOOD, fp32_contents=[0.5] * 10),
        "INVALID_ARGUMENT",
    ),
    "raw bytes short": (
        lambda: _edit(_fp32(GOOD), lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 12)),
        "INVALID_ARGUMENT",
    ),
    "raw for no input": (
        lambda: _edit(_fp32(GOOD), lambda r: r.raw_input_contents.append(b"")),
        "INVALID_ARGUMENT",
    ),
    "raw and contents": (
        lambda: _edit(_fp32(GOOD), lambda r: r.inputs[0].contents.fp32_contents.append(0.5)),
        "INVALID_ARGUMENT",
    ),
    "values in the wrong field": (
        lambda: _request("FP32", [1], int_contents=[1]),
        "INVALID_ARGUMENT",
    ),
    "fp16 as contents": (lambda: _request("FP16", [1], fp32_contents=[0.5]), "INVALID_ARGUMENT"),
    "NaN": (lambda: _fp32(GOOD, np.full(GOOD, np.nan)), "INVALID_ARGUMENT"),
    "outside the value range": (lambda: _fp32(GOOD, np.full(GOOD, 5.0)), "INVALID_ARGUMENT"),
    "negative dimension": (lambda: _fp32([-1, 1, 28, 28], np.zeros(0)), "INVALID_ARGUMENT"),
    "empty shape": (lambda: _request("FP32", [], fp32_contents=[0.5]), "INVALID_ARGUMENT"),
    "no images": (lambda: _fp32([0, 1, 28, 28]), "INVALID_ARGUMENT"),
    "not an image": (lambda: _images(b"not an image"), "INVALID_ARGUMENT"),
    "format not accepted": (lambda: _images(ico_image()), "INVALID_ARGUMENT"),
    "fewer images than the shape": (
        lambda: _images(encode(np.zeros((28, 28), np.uint8)), shape=[2]),
        "INVALID_ARGUMENT",
    ),
    "truncated element": (
        lambda: _edit(
            _images(b""),
            lambda r: r.raw_input_contents.__setitem__(0, struct.pack("<I", 100) + b"abcd"),
        ),
        "INVALID_ARGUMENT",
    ),
    "unknown output": (
        lambda: _edit(_fp32(GOOD), lambda r: r.outputs.add(name="logits")),
        "INVALID_ARGUMENT",
    ),
    "image over max_pixels": (lambda: _images(decompression_bomb()), "RESOURCE_EXHAUSTED"),
    "more images than the limit": (lambda: _fp32([9, 1, 28, 28]), "RESOURCE_EXHAUSTED"),
    "dimension over 2**31": (
        lambda: _request("FP32", [2**40, 1], fp32_contents=[0.5]),
        "RESOURCE_EXHAUSTED",
    ),
    "message over max_body_bytes": (lambda: _fp32([2, 1, 280, 280]), "RESOURCE_EXHAUSTED"),
    "unknown model": (
        lambda: _edit(_fp32(GOOD), lambda r: setattr(r, "model_name", "other")),
        "NOT_FOUND",
    ),
    "unknown version": (
        lambda: _edit(_fp32(GOOD), lambda r: setattr(r, "model_version", "6")),
        "NOT_FOUND",
    ),
}


def test_malformed_requests_get_a_status_code_and_the_server_stays_up(live, stub, client) -> None:
    answers = {}
    for name, (build, _) in MALFORMED.items():
        try:
            stub.ModelInfer(build(), metadata=tuple(KEY.items()), timeout=60)
            answers[name] = "OK"
        except grpc.RpcError as refused:
            answers[name] = refused.code().name
            assert refused.details(), name
    assert answers == {name: code for name, (_, code) in MALFORMED.items()}
    assert client.is_server_live() and client.is_server_ready()
    assert httpx.get(live.url + "/readyz").status_code == 200
    _grpc_answer(client, "input", synthetic_images(1, seed=14), "FP32")


# ---- the API key, the query memory and the metrics, shared with REST ---------------------------
def test_the_api_key_is_required_for_inference(stub) -> None:
    request = _fp32(GOOD)
    for metadata in ((), (("x-api-key", "wrong"),), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, metadata=metadata, timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
    answer = stub.ModelInfer(request, metadata=(("authorization", f"Bearer {API_KEY}"),))
    assert answer.model_name == MODEL
    assert stub.ServerReady(pb.ServerReadyRequest()).ready  # health needs no key, as in REST


def test_query_memory_and_metrics_are_shared_with_rest(live, client) -> None:
    """A client (its API key) probing near-duplicates over REST is caught over gRPC too; gRPC
    calls are counted, and their images go through the same batcher and counters."""
    probes = near_duplicates(synthetic_images(1, seed=99)[0], 4, 0.01, seed=0)
    tensor = {"name": "input", "shape": [1, *probes.shape[1:]], "datatype": "FP32"}
    before = _metric(httpx.get(live.url + "/metrics").text, "lapguard_images_total")
    for probe in probes[:3]:
        rest = _rest_answer(live, {**tensor, "data": probe.reshape(-1).tolist()})
        assert rest["query_attack"].tolist() == [False]
    tensor_in = triton.InferInput("input", tensor["shape"], "FP32")
    tensor_in.set_data_from_numpy(probes[3:])
    result = client.infer(MODEL, [tensor_in], headers=KEY)
    assert result.as_numpy("query_attack").tolist() == [True]
    metrics = httpx.get(live.url + "/metrics").text
    assert _metric(metrics, "lapguard_images_total") == before + 4
    calls = 'lapguard_grpc_requests_total{code="OK",method="ModelInfer"}'
    assert _metric(metrics, calls) >= 1
    assert 'lapguard_grpc_requests_total{code="INVALID_ARGUMENT",method="ModelInfer"}' in metrics


def _metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].rsplit(" ", 1)[1])


# ---- readiness and the process ------------------------------------------------------------------
def test_not_ready_answers_unavailable(service_bundle, guard) -> None:
    held = HeldWarmup(guard)
    settings = Settings(bundle=service_bundle, grpc_port=0)
    with LiveServer(settings, guard=held, wait_for="/healthz") as server:
        with triton.InferenceServerClient(_target(server)) as c:
            assert c.is_server_live() and not c.is_server_ready()
            assert not c.is_model_ready(MODEL)
            tensor = triton.InferInput("input", GOOD, "FP32")
            tensor.set_data_from_numpy(synthetic_images(1, seed=15))
            with pytest.raises(InferenceServerException) as refused:
                c.infer(MODEL, [tensor])
            assert _status(refused.value) == "UNAVAILABLE"
        held.release.set()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_lapguard_serve_grpc_port(service_bundle) -> None:
    """`lapguard serve --grpc-port P` answers on both ports and stops both on SIGTERM."""
    port, grpc_port = _free_port(), _free_port()
    process = _serve(service_bundle, "--port", str(port), "--grpc-port", str(grpc_port))
    try:
        with triton.InferenceServerClient(f"127.0.0.1:{grpc_port}") as c:
            for _ in range(900):
                try:
                    if c.is_server_ready():
                        break
                except InferenceServerException:
                    pass
                assert process.poll() is None, process.communicate()[1][-2000:]
                time.sleep(0.1)
            tensor = triton.InferInput("input", GOOD, "FP32")
            tensor.set_data_from_numpy(synthetic_images(1, seed=16))
            assert c.infer(MODEL, [tensor]).as_numpy("label").shape == (1,)
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode in (0, -signal.SIGTERM), stderr[-2000:]
    finally:
        process.kill()


def test_rest_alone_does_not_import_grpc(service_bundle) -> None:
    code = (
        "import sys; from service.app import create_app; from service.server import build_server;"
        "from service.settings import Settings;"
        f"build_server(Settings(bundle={str(service_bundle)!r}, device='cpu'));"
        "assert 'grpc' not in sys.modules, 'grpc imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
