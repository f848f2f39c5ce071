"""Open Inference Protocol (KServe v2) tensors: JSON ``data`` and the binary tensor extension.

Binary extension (as Triton and the KServe clients send it): the body is the JSON inference header
followed by raw tensor bytes; the header's length is in ``Inference-Header-Content-Length`` and
each binary input says its byte count in ``parameters.binary_data_size``. Numbers are
little-endian, BOOL is one byte per element, and each BYTES element is a 4-byte little-endian
length followed by its bytes. Outputs are returned in binary when the output asks for
``parameters.binary_data`` or the request for ``parameters.binary_data_output``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from detector.errors import InputError, InputTooLargeError
from service.schemas import Datatype, InferenceRequest, RequestInput, ResponseOutput

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_MEDIA_TYPE = "application/octet-stream"
MAX_DIMENSION = 2**31 - 1  # any one dimension of an input's shape

NUMPY_DTYPES: dict[str, str] = {
    "BOOL": "|b1",
    "UINT8": "|u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "|i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}


@dataclass
class OutputTensor:
    name: str
    datatype: Datatype
    array: np.ndarray


def parse_request(
    body: bytes, header_length: str | None
) -> tuple[InferenceRequest, list[bytes | None]]:
    """The inference header and, per input, its binary bytes (None when it came as JSON ``data``)."""
    if header_length is None:
        header, binary = body, b""
    else:
        length_text = header_length.strip()
        if not (length_text.isascii() and length_text.isdigit()):
            raise InputError(f"{HEADER_LENGTH} must be a byte count, got {header_length!r}")
        length = int(length_text)
        if length > len(body):
            raise InputError(f"{HEADER_LENGTH} is {length} but the body has only {len(body)} bytes")
        header, binary = body[:length], body[length:]
    request = InferenceRequest.model_validate_json(header)  # ValidationError -> 422
    chunks: list[bytes | None] = []
    offset = 0
    for tensor in request.inputs:
        size = (tensor.parameters or {}).get("binary_data_size")
        if size is None:
            chunks.append(None)
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InputError(
                f"input {tensor.name!r}: binary_data_size must be a non-negative integer"
            )
        if offset + size > len(binary):
            raise InputError(
                f"input {tensor.name!r}: binary_data_size {size} runs past the end of the binary data "
                f"({len(binary) - offset} bytes left)"
            )
        chunks.append(binary[offset : offset + size])
        offset += size
    if offset != len(binary):
        raise InputError(
            f"{len(binary) - offset} bytes of binary data are not claimed by any input's binary_data_size"
        )
    return request, chunks


def element_count(tensor: RequestInput, *, max_first_dim: int) -> int:
    """Checks the shape (non-negative, first dimension within the image limit, each dimension
    at most :data:`MAX_DIMENSION`) and returns its size."""
    if not tensor.shape or any(d < 0 for d in tensor.shape):
        raise InputError(
            f"input {tensor.name!r}: shape {tensor.shape} must be non-empty and non-negative"
        )
    if any(d > MAX_DIMENSION for d in tensor.shape):
        raise InputTooLargeError(
            f"input {tensor.name!r}: shape {tensor.shape} has a dimension over {MAX_DIMENSION}"
        )
    if tensor.shape[0] > max_first_dim:
        raise InputTooLargeError(
            f"input {tensor.name!r}: {tensor.shape[0]} images in one request, more than the limit of {max_first_dim}"
        )
    return math.prod(tensor.shape)


def decode_numeric(tensor: RequestInput, chunk: bytes | None, *, max_first_dim: int) -> np.ndarray:
    """A numeric input as an array of its shape (from JSON ``data`` or the binary chunk)."""
    count = element_count(tensor, max_first_dim=max_first_dim)
    dtype = np.dtype(NUMPY_DTYPES[tensor.datatype])
    if chunk is not None:
        if len(chunk) != count * dtype.itemsize:
            raise InputError(
                f"input {tensor.name!r}: shape {tensor.shape} {tensor.datatype} needs {count * dtype.itemsize} "
                f"bytes, got {len(chunk)}"
            )
        array = np.frombuffer(chunk, dtype=dtype)
    else:
        if tensor.data is None:
            raise InputError(
                f"input {tensor.name!r} has neither data nor parameters.binary_data_size"
            )
        array = _json_array(tensor, dtype)
        if array.size != count:
            raise InputError(
                f"input {tensor.name!r}: shape {tensor.shape} needs {count} values, data has {array.size}"
            )
    try:
        shaped = array.reshape(tensor.shape)
    except ValueError as error:  # a zero-sized shape numpy cannot hold
        raise InputError(
            f"input {tensor.name!r}: shape {tensor.shape} is not usable: {error}"
        ) from error
    return shaped.astype(dtype.newbyteorder("="))  # a writable native copy


def _json_array(tensor: RequestInput, dtype: np.dtype) -> np.ndarray:
    """A numeric input's JSON ``data`` as ``dtype``: JSON booleans for BOOL, JSON numbers that
    ``dtype`` holds for the others (strings, nulls and ragged lists are refused, not coerced)."""
    wanted = "b" if tensor.datatype == "BOOL" else "iuf"
    try:
        values = np.asarray(tensor.data)
        if values.size and values.dtype.kind not in wanted:
            raise TypeError(f"its values are not JSON {'booleans' if wanted == 'b' else 'numbers'}")
        return values.astype(dtype)
    except (ValueError, TypeError, OverflowError) as error:
        raise InputError(
            f"input {tensor.name!r}: data is not a regular {tensor.datatype} array: {error}"
        ) from error


def decode_bytes(tensor: RequestInput, chunk: bytes | None, *, max_first_dim: int) -> list[bytes]:
    """A BYTES input as its elements: length-prefixed in binary, base64 strings in JSON."""
    count = element_count(tensor, max_first_dim=max_first_dim)
    if chunk is not None:
        items: list[bytes] = []
        offset = 0
        while offset < len(chunk):
            if offset + 4 > len(chunk):
                raise InputError(f"input {tensor.name!r}: truncated BYTES element length")
            (size,) = struct.unpack_from("<I", chunk, offset)
            offset += 4
            if offset + size > len(chunk):
                raise InputError(
                    f"input {tensor.name!r}: BYTES element {len(items)} runs past the data"
                )
            items.append(chunk[offset : offset + size])
            offset += size
    else:
        if tensor.data is None:
            raise InputError(
                f"input {tensor.name!r} has neither data nor parameters.binary_data_size"
            )
        flat = list(_flatten(tensor.data))
        if not all(isinstance(item, str) for item in flat):
            raise InputError(f"input {tensor.name!r}: BYTES data in JSON must be base64 strings")
        items = []
        for i, item in enumerate(flat):
            try:
                items.append(base64.b64decode("".join(item.split()), validate=True))
            except (binascii.Error, ValueError) as error:
                raise InputError(
                    f"input {tensor.name!r}[{i}] is not valid base64: {error}"
                ) from error
    if len(items) != count:
        raise InputError(
            f"input {tensor.name!r}: shape {tensor.shape} needs {count} elements, got {len(items)}"
        )
    return items


def _flag(parameters: dict[str, Any] | None, name: str, default: bool) -> bool:
    """A boolean request parameter: a JSON true or false, or ``default`` when absent."""
    value = (parameters or {}).get(name, default)
    if not isinstance(value, bool):
        raise InputError(f"parameters.{name} must be true or false, got {value!r}")
    return value


def _flatten(data: Any) -> Any:
    for item in data:
        if isinstance(item, list):
            yield from _flatten(item)
        else:
            yield item


def select_outputs(available: Sequence[OutputTensor], names: Sequence[str]) -> list[OutputTensor]:
    """The outputs named, in order (all when none are named); an unknown name is refused."""
    by_name = {tensor.name: tensor for tensor in available}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise InputError(f"unknown output {unknown[0]!r}; this model has {', '.join(by_name)}")
    return [by_name[name] for name in names] if names else list(available)


def tensor_bytes(tensor: OutputTensor) -> bytes:
    """An output's values in the binary layout (little-endian, BOOL one byte each)."""
    array = np.ascontiguousarray(tensor.array)
    return array.astype(np.dtype(NUMPY_DTYPES[tensor.datatype]), copy=False).tobytes()


def encode_outputs(
    request: InferenceRequest, available: Sequence[OutputTensor]
) -> tuple[list[ResponseOutput], bytes]:
    """The requested outputs (all when none are named) as JSON data or binary chunks."""
    binary_default = _flag(request.parameters, "binary_data_output", False)
    requested = request.outputs or []
    chosen = select_outputs(available, [output.name for output in requested])
    binary_flags = [_flag(o.parameters, "binary_data", binary_default) for o in requested]
    outputs: list[ResponseOutput] = []
    chunks: list[bytes] = []
    for tensor, binary in zip(chosen, binary_flags or [binary_default] * len(chosen), strict=True):
        shape = list(np.shape(tensor.array))
        if binary:
            raw = tensor_bytes(tensor)
            chunks.append(raw)
            outputs.append(
                ResponseOutput(
                    name=tensor.name,
                    datatype=tensor.datatype,
                    shape=shape,
                    parameters={"binary_data_size": len(raw)},
                )
            )
        else:
            outputs.append(
                ResponseOutput(
                    name=tensor.name,
                    datatype=tensor.datatype,
                    shape=shape,
                    data=np.asarray(tensor.array).reshape(-1).tolist(),
                )
            )
    return outputs, b"".join(chunks)


def response_body(header: dict[str, Any], binary: bytes) -> tuple[bytes, dict[str, str], str]:
    """Body, extra headers and media type of an inference response."""
    encoded = json.dumps(header, separators=(",", ":")).encode()
    if not binary:
        return encoded, {}, "application/json"
    return encoded + binary, {HEADER_LENGTH: str(len(encoded))}, BINARY_MEDIA_TYPE


# ---- the client side (batch scoring over HTTP) -------------------------------------------------
def binary_request(
    name: str, array: np.ndarray, datatype: Datatype, *, outputs: Sequence[str]
) -> tuple[bytes, dict[str, str]]:
    """Body and headers of an infer request with one input in the binary tensor extension,
    asking for ``outputs`` in JSON."""
    tensor = np.ascontiguousarray(array, dtype=NUMPY_DTYPES[datatype])
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "datatype": datatype,
                    "shape": list(tensor.shape),
                    "parameters": {"binary_data_size": tensor.nbytes},
                }
            ],
            "outputs": [{"name": output} for output in outputs],
        }
    ).encode()
    headers = {HEADER_LENGTH: str(len(header)), "Content-Type": BINARY_MEDIA_TYPE}
    return header + tensor.tobytes(), headers


def json_outputs(answer: dict[str, Any]) -> dict[str, np.ndarray]:
    """The outputs of an infer response answered in JSON, by name, in their shapes."""
    return {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in answer.get("outputs", [])}
