"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``, as published by
``tritonclient[grpc]``), served by ``grpc.aio`` on the app's event loop from the same runtime as
the REST routes: same micro-batcher, Guard, API key (metadata ``x-api-key`` or
``authorization: Bearer KEY``), query memory and metrics. Started and stopped by the app's
lifespan (``--grpc-port``); Triton's other RPCs answer UNIMPLEMENTED.

Errors map to status codes through their HTTP status (:func:`service.errors.status_of`), so
both transports refuse the same requests for the same reasons.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from pydantic import ValidationError
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from detector.errors import ConfigError, LapguardError
from service import open_inference
from service.errors import RetryableError, status_of, validation_message
from service.grpc_tensors import infer_response, metadata_response, request_inputs
from service.inference_protocol import select_outputs
from service.keys import check_api_key, client_of
from service.logs import request_id_var
from service.open_inference import check_model
from service.runtime import Runtime

logger = logging.getLogger("lapguard.service")
access_logger = logging.getLogger("lapguard.service.access")

#: The status code of each HTTP status an error maps to (others: INTERNAL).
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
_QUIET_METHODS = {"ServerLive", "ServerReady", "ModelReady"}

Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def refusal(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message of an error raised while answering."""
    if isinstance(error, ValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT, validation_message(error)
    if isinstance(error, LapguardError):
        status, _ = status_of(error)
        if status >= 500 and status != 503:
            logger.error("request failed: %s", error, exc_info=error)
        return STATUS_CODES.get(status, grpc.StatusCode.INTERNAL), str(error)
    logger.error("unhandled error: %r", error, exc_info=error)
    return grpc.StatusCode.INTERNAL, "internal server error; see the server log"


def answered(method: Handler) -> Handler:
    """An RPC whose errors become status codes (never a crash), timed and logged like REST."""

    @functools.wraps(method)
    async def handle(
        self: InferenceServicer, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        token = request_id_var.set(uuid.uuid4().hex)
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await method(self, request, context)
        except Exception as error:
            code, message = refusal(error)
            retry = error.retry_after if isinstance(error, RetryableError) else None
            trailers = (("retry-after", str(max(1, round(retry)))),) if retry else ()
            await context.abort(code, message, trailers)
        finally:
            self.record(method.__name__, code, time.perf_counter() - started, context)
            request_id_var.reset(token)

    return handle


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The protocol's health, metadata and inference calls on one :class:`Runtime`."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    @answered
    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @answered
    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._ready())

    @answered
    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        check_model(self.runtime, request.name, request.version or None)
        return pb.ModelReadyResponse(ready=self._ready())

    @answered
    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        metadata = open_inference.server_metadata([])
        return pb.ServerMetadataResponse(name=metadata.name, version=metadata.version)

    @answered
    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        check_model(self.runtime, request.name, request.version or None)
        return metadata_response(open_inference.model_metadata(self.runtime))

    @answered
    async def ModelInfer(self, request: Any, context: Any) -> pb.ModelInferResponse:
        runtime, headers = self.runtime, _metadata(context)
        check_api_key(headers, runtime.settings)
        check_model(runtime, request.model_name, request.model_version or None)
        runtime.check_ready()
        client = client_of(headers, _peer_address(context.peer()), runtime.settings)
        await runtime.admit_client(client)
        inputs, chunks = request_inputs(request)
        result, available = await open_inference.infer(runtime, client, inputs, chunks)
        outputs = select_outputs(available, [output.name for output in request.outputs])
        return infer_response(request, runtime.answered_by(result), result.threshold, outputs)

    def _ready(self) -> bool:
        try:
            self.runtime.check_ready()
        except LapguardError:
            return False
        return True

    def record(self, method: str, code: grpc.StatusCode, seconds: float, context: Any) -> None:
        """The call in the metrics (``lapguard_grpc_*``) and the access log."""
        metrics = self.runtime.metrics
        metrics.grpc_requests.labels(method, code.name).inc()
        metrics.grpc_latency.labels(method, code.name).observe(seconds)
        ok = code == grpc.StatusCode.OK
        level = logging.DEBUG if method in _QUIET_METHODS and ok else logging.INFO
        if access_logger.isEnabledFor(level):
            access_logger.log(
                level,
                "request",
                extra={
                    "method": "gRPC",
                    "route": method,
                    "status": code.name,
                    "duration_ms": round(seconds * 1000, 3),
                    "client": _peer_address(context.peer()),
                },
            )


def _unimplemented(name: str) -> Handler:
    async def refuse(self: InferenceServicer, request: Any, context: Any) -> Any:
        self.record(name, grpc.StatusCode.UNIMPLEMENTED, 0.0, context)
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"{name} is not served here: lapguard serves the Open Inference Protocol's "
            "health, metadata and ModelInfer calls",
        )

    return refuse


# Triton's calls beyond the Open Inference Protocol (statistics, repository, shared memory, ...).
for _name in list(vars(service_pb2_grpc.GRPCInferenceServiceServicer)):
    if not _name.startswith("_") and _name not in vars(InferenceServicer):
        setattr(InferenceServicer, _name, _unimplemented(_name))


def _metadata(context: Any) -> dict[str, str]:
    """The call's text metadata (gRPC names are lower case)."""
    return {
        key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)
    }


def _peer_address(peer: str | None) -> str | None:
    """The host of a peer such as ``ipv4:127.0.0.1:5000`` or ``ipv6:[::1]:5000``."""
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return peer


class GrpcEndpoint:
    """The gRPC server of one app: started after the runtime, stopped before it."""

    def __init__(self, server: grpc.aio.Server, port: int) -> None:
        self.server = server
        self.port = port

    @classmethod
    async def start(cls, runtime: Runtime) -> GrpcEndpoint:
        """Listen on ``settings.grpc_port`` (0: any free port, see :attr:`port`)."""
        s = runtime.settings
        assert s.grpc_port is not None
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", s.max_body_bytes),  # over: RESOURCE_EXHAUSTED
                ("grpc.so_reuseport", 0),  # a port already in use is an error, not shared
            ]
        )
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(runtime), server
        )
        host = f"[{s.host}]" if ":" in s.host and not s.host.startswith("[") else s.host
        try:
            port = server.add_insecure_port(f"{host}:{s.grpc_port}")
        except RuntimeError as error:
            raise ConfigError(f"cannot listen for gRPC on {host}:{s.grpc_port}: {error}") from error
        await server.start()
        logger.info("gRPC endpoint listening", extra={"host": s.host, "port": port})
        return cls(server, port)

    async def stop(self, grace: float) -> None:
        """Refuse new calls, give those in flight up to ``grace`` seconds, then cancel them."""
        await self.server.stop(grace)
