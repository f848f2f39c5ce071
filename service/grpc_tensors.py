"""Open Inference Protocol tensors in gRPC messages (the ``inference`` protos that
``tritonclient[grpc]`` publishes): request inputs into the form the shared decoders read (a
:class:`RequestInput` and its bytes in the binary tensor layout), and outputs, metadata and
answers back into messages."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from detector.errors import InputError
from service.inference_protocol import NUMPY_DTYPES, OutputTensor, tensor_bytes
from service.schemas import ModelMetadata, RequestInput, TensorMetadata

#: The typed ``contents`` field of each datatype (FP16 has none: raw_input_contents only).
CONTENTS_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def request_inputs(request: pb.ModelInferRequest) -> tuple[list[RequestInput], list[bytes]]:
    """Each input's description and its bytes in the binary tensor layout: the matching
    ``raw_input_contents`` entry, or its typed ``contents`` laid out the same way."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InputError(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs; "
            "send one per input, in order"
        )
    inputs, chunks = [], []
    for index, tensor in enumerate(request.inputs):
        described = RequestInput.model_validate(
            {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        )  # ValidationError: an unknown datatype
        if raw and tensor.contents.ListFields():
            raise InputError(
                f"input {tensor.name!r} has contents although the request uses raw_input_contents"
            )
        inputs.append(described)
        chunks.append(raw[index] if raw else _contents_bytes(tensor, described))
    return inputs, chunks


def _contents_bytes(
    tensor: pb.ModelInferRequest.InferInputTensor, described: RequestInput
) -> bytes:
    """The typed ``contents`` of an input in the binary tensor layout (little-endian numbers,
    BYTES elements each after its 4-byte length), which the shared decoders check."""
    field = CONTENTS_FIELDS.get(described.datatype)
    filled = [descriptor.name for descriptor, _ in tensor.contents.ListFields()]
    if field is None:
        raise InputError(
            f"input {tensor.name!r}: {described.datatype} values travel in raw_input_contents only"
        )
    if any(name != field for name in filled):
        wrong = next(name for name in filled if name != field)
        raise InputError(
            f"input {tensor.name!r}: {described.datatype} values go in contents.{field}, "
            f"got contents.{wrong}"
        )
    values = getattr(tensor.contents, field)
    if described.datatype == "BYTES":
        return b"".join(struct.pack("<I", len(item)) + item for item in values)
    try:
        return np.asarray(values, dtype=NUMPY_DTYPES[described.datatype]).tobytes()
    except (OverflowError, ValueError) as error:
        raise InputError(
            f"input {tensor.name!r}: values do not fit {described.datatype}: {error}"
        ) from error


def infer_response(
    request: pb.ModelInferRequest,
    answered_by: tuple[str, str],
    threshold: float,
    outputs: Sequence[OutputTensor],
) -> pb.ModelInferResponse:
    """The answer: ``outputs`` in ``raw_output_contents`` (as Triton answers), the decision
    threshold in ``parameters``."""
    name, version = answered_by
    response = pb.ModelInferResponse(model_name=name, model_version=version, id=request.id)
    response.parameters["threshold"].double_param = float(threshold)
    for tensor in outputs:
        response.outputs.add(
            name=tensor.name, datatype=tensor.datatype, shape=list(np.shape(tensor.array))
        )
        response.raw_output_contents.append(tensor_bytes(tensor))
    return response


def metadata_response(metadata: ModelMetadata) -> pb.ModelMetadataResponse:
    """The model's metadata as a message (which has no ``parameters``: the class names are in
    the REST answer only)."""

    def tensors(items: list[TensorMetadata]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
        return [
            pb.ModelMetadataResponse.TensorMetadata(
                name=item.name, datatype=item.datatype, shape=item.shape
            )
            for item in items
        ]

    return pb.ModelMetadataResponse(
        name=metadata.name,
        versions=metadata.versions,
        platform=metadata.platform,
        inputs=tensors(metadata.inputs),
        outputs=tensors(metadata.outputs),
    )
