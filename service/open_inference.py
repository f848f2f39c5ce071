"""The served model under the Open Inference Protocol, whatever the transport (REST in
``routes/v2.py``, gRPC in ``grpc_endpoint.py``): which model answers, its metadata, and one
inference from decoded request tensors to output tensors.

The model takes ONE input per request, either FP32 ``[N, C, H, W]`` in the input spec's value
range (FP16/FP64 are converted) or BYTES ``[N]``, encoded image files; any input name is
accepted, the datatype decides. Outputs: ``probabilities`` FP32 ``[N, K]``, ``label`` INT64
``[N]``, ``flagged`` BOOL ``[N]``, ``score`` FP32 ``[N]`` (higher = more abnormal),
``query_attack`` BOOL ``[N]`` (the client's recent queries hold near-duplicates of the image).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import detector
from detector.errors import InputError
from detector.guard import GuardResult
from service.errors import ModelNotFoundError
from service.inference_protocol import OutputTensor, decode_bytes, decode_numeric
from service.runtime import Runtime
from service.schemas import ModelMetadata, RequestInput, ServerMetadata, TensorMetadata

SERVER_NAME = "lapguard"
FLOAT_DATATYPES = ("FP32", "FP64", "FP16")


def server_metadata(extensions: list[str]) -> ServerMetadata:
    """The server's name, version and the protocol ``extensions`` its transport supports."""
    return ServerMetadata(name=SERVER_NAME, version=detector.__version__, extensions=extensions)


def check_model(runtime: Runtime, name: str, version: str | None) -> None:
    """:class:`ModelNotFoundError` unless ``name`` (and ``version``, when given) is served."""
    if name != runtime.model_name:
        raise ModelNotFoundError(
            f"unknown model {name!r}; this server serves {runtime.model_name!r}"
        )
    if version is not None and version != runtime.model_version:
        raise ModelNotFoundError(
            f"unknown version {version!r} of model {name!r}; this server serves version {runtime.model_version!r}"
        )


def model_metadata(runtime: Runtime) -> ModelMetadata:
    """The served model's inputs (two alternatives) and outputs."""
    spec = runtime.input_spec
    classes = len(runtime.class_names) or -1
    return ModelMetadata(
        name=runtime.model_name,
        versions=[runtime.model_version],
        platform=SERVER_NAME,
        inputs=[
            TensorMetadata(
                name="input",
                datatype="FP32",
                shape=[-1, spec.channels, spec.height, spec.width],
                parameters={"value_range": list(spec.value_range), "alternative_to": "image"},
            ),
            TensorMetadata(
                name="image", datatype="BYTES", shape=[-1], parameters={"alternative_to": "input"}
            ),
        ],
        outputs=[
            TensorMetadata(name="probabilities", datatype="FP32", shape=[-1, classes]),
            TensorMetadata(name="label", datatype="INT64", shape=[-1]),
            TensorMetadata(name="flagged", datatype="BOOL", shape=[-1]),
            TensorMetadata(
                name="score",
                datatype="FP32",
                shape=[-1],
                parameters={"direction": "higher = more abnormal"},
            ),
            TensorMetadata(
                name="query_attack",
                datatype="BOOL",
                shape=[-1],
                parameters={"meaning": "near-duplicates in this client's recent queries"},
            ),
        ],
        parameters={"class_names": runtime.class_names},
    )


async def infer(
    runtime: Runtime, client: str, inputs: Sequence[RequestInput], chunks: Sequence[bytes | None]
) -> tuple[GuardResult, list[OutputTensor]]:
    """Score the request's one input (``chunks[i]``: input ``i``'s bytes in the binary tensor
    layout, None when it came as JSON ``data``) for ``client``; the result and every output.
    The caller has checked the key, the model and readiness, and admitted the client."""
    if len(inputs) != 1:
        raise InputError(
            f"send exactly one input (FP32 'input' [N, C, H, W] or BYTES 'image' [N]), got {len(inputs)}"
        )
    tensor, chunk = inputs[0], chunks[0]
    limit = runtime.settings.max_images_per_request
    if tensor.datatype == "BYTES":
        blobs = decode_bytes(tensor, chunk, max_first_dim=limit)
        names = [f"{tensor.name}[{i}]" for i in range(len(blobs))]
        result = await runtime.score_encoded(blobs, names)
    elif tensor.datatype in FLOAT_DATATYPES:
        array = decode_numeric(tensor, chunk, max_first_dim=limit).astype(np.float32)
        result = await runtime.score_array(array)
    else:
        raise InputError(
            f"input {tensor.name!r} has datatype {tensor.datatype}; send FP32 [N, C, H, W] or BYTES encoded images"
        )
    query_attack = await runtime.screen_queries(client, result)
    return result, [
        OutputTensor("probabilities", "FP32", np.asarray(result.probabilities, dtype=np.float32)),
        OutputTensor("label", "INT64", np.asarray(result.labels, dtype=np.int64)),
        OutputTensor("flagged", "BOOL", np.asarray(result.flagged, dtype=bool)),
        OutputTensor("score", "FP32", np.asarray(result.scores, dtype=np.float32)),
        OutputTensor("query_attack", "BOOL", query_attack),
    ]
