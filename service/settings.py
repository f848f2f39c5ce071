"""Service settings: ``LAPGUARD_*`` environment variables, overridden by CLI flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from detector.errors import ConfigError
from detector.images import DEFAULT_FORMATS, DEFAULT_MAX_PIXELS, readable_formats

LogLevel = Literal["critical", "error", "warning", "info", "debug"]

#: Query signature levels and neighbour count; see ``query_levels`` and docs/decisions.md,
#: "Query signature levels and neighbours".
QUERY_LEVELS = 4
QUERY_NEIGHBOURS = 3

#: A TCP port to listen on (0: any free port).
Port = Annotated[int, Field(ge=0, le=65535)]


class Settings(BaseSettings):
    """Everything the server can be told. Environment: ``LAPGUARD_<FIELD>`` (e.g. ``LAPGUARD_PORT``)."""

    model_config = SettingsConfigDict(
        env_prefix="LAPGUARD_", extra="ignore", frozen=True, allow_inf_nan=False
    )

    bundle: Path | None = Field(default=None, description="bundle directory to serve")
    host: str = Field(
        default="127.0.0.1", description="interface to bind; 0.0.0.0 only inside a container"
    )
    port: Port = 8000
    grpc_port: Port | None = Field(
        default=None,
        description=(
            "port of the gRPC Open Inference Protocol endpoint, beside REST on the same host "
            "(unset: off; 0: any free port; needs the grpc extra)"
        ),
    )
    state_file: Path | None = Field(
        default=None,
        description=(
            "where the server records the address it listens on once it does (removed on stop): "
            "the container health check reads the port there, since it never sees the server's "
            "--port flag; the images set /tmp/lapguard-server.json"
        ),
    )
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N")
    target_fpr: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description=(
            "flag at the bundle's operating point for this target false-positive rate (one of "
            "its manifest's operating_points; default: the target it was calibrated for)"
        ),
    )
    model_name: str | None = Field(
        default=None, description="name served under /v2/models (default: the bundle's)"
    )
    progress_file: Path | None = Field(
        default=None,
        description=(
            "progress.json of a pipeline run building the next bundle (`lapguard demo` sets it); "
            "GET /v1/model reports it as `building`"
        ),
    )

    # Micro-batching
    max_batch_size: int = Field(
        default=256,
        ge=1,
        le=4096,
        description=(
            "most images per forward pass; a batch takes what is queued, so this only caps it "
            "(measured on 2 cores: 4 clients of 64-image requests gain ~7% at 256 against 64, "
            "which kept each request in a batch of its own)"
        ),
    )
    max_wait_ms: float = Field(
        default=0.0,
        ge=0,
        le=1000,
        description=(
            "longest wait to fill a batch; at 0, requests that arrive while the network "
            "computes form the next batch (measured on 2 CPU cores: single-client p50 5.1 ms "
            "at 0 vs 10.9 ms at 2 ms, the same throughput under 32 clients)"
        ),
    )
    batch_linger: float = Field(
        default=0.5,
        ge=0,
        le=4,
        description=(
            "while fewer images are queued than the previous batch had, wait up to this "
            "fraction of its compute time for the clients just answered to send their next "
            "requests (0: take what is queued at once)"
        ),
    )
    max_queue: int = Field(
        default=512, ge=1, description="most images waiting; more are answered 429"
    )
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        description=(
            "threads of the network's forward pass (torch intra-op); unset, chosen per batch: one "
            "less than the cores (at least 1) for batches of small requests, so the event loop "
            "keeps a core, and every core for batches of large requests (8+ images each on "
            "average), whose reading and decoding cost the loop little (measured on 2 cores: 1 "
            "thread gives 2.5x lower one-client latency and 1.3x the throughput of 32 "
            'single-image clients; docs/decisions.md, "Forward-pass threads")'
        ),
    )

    # Request limits
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="largest request body"
    )
    max_images_per_request: int = Field(default=64, ge=1)
    max_pixels: int = Field(
        default=DEFAULT_MAX_PIXELS, ge=1, description="largest image (width x height)"
    )
    image_formats: tuple[str, ...] = DEFAULT_FORMATS

    # Security and operations
    api_key: SecretStr | None = Field(
        default=None, description="required on inference routes when set"
    )
    admin_key: SecretStr | None = Field(
        default=None,
        description=(
            "required on admin routes (POST /v1/admin/reload) when set; unset, they take the "
            "api_key, and with neither they are refused (SIGHUP still reloads)"
        ),
    )
    log_level: LogLevel = "info"
    graceful_timeout_s: float = Field(
        default=20.0, ge=0, description="time to finish in-flight requests on stop"
    )
    warmup: bool = Field(default=True, description="run warm-up forwards before reporting ready")

    # Stateful detection of query-based black-box attacks (service/query_memory.py)
    query_memory: Literal["off", "memory", "redis"] = Field(
        default="memory",
        description="where per-client query histories live: this process, Redis (several replicas), or off",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0", description="the Redis of query_memory=redis"
    )
    query_client: Literal["auto", "address"] = Field(
        default="auto",
        description="who a client is: auto = the API key it sends when a key is configured, else its address",
    )
    query_levels: int = Field(
        default=QUERY_LEVELS,
        ge=3,
        le=16,
        description=(
            "pixel levels of the query signature: two queries are neighbours when no pixel's level "
            "differs by 2 or more, which covers any L-infinity ball of radius 1/(2*levels) "
            "(value range = 1); default 4 (eps <= 0.125), calibrated on the 10,000 distinct clean "
            "Fashion-MNIST test images (benchmarks/query_memory.py)"
        ),
    )
    query_neighbours: int = Field(
        default=QUERY_NEIGHBOURS,
        ge=1,
        description=(
            "a query is an attack when this many stored ones are its neighbours (or two, one "
            "of which the network labelled otherwise)"
        ),
    )
    query_history: int = Field(
        default=1000, ge=1, le=100_000, description="queries remembered per client (a ring)"
    )
    query_max_clients: int = Field(
        default=1024,
        ge=1,
        description="clients remembered in process (least recently seen evicted)",
    )
    query_seed: int = Field(
        default=0,
        description="salt of the signature (pixel order, digest); set a private value, the same on every replica",
    )
    query_ttl_s: float = Field(
        default=3600.0, gt=0, description="Redis: a client's history expires after this idle time"
    )
    query_attack_action: Literal["flag", "403", "429"] = Field(
        default="flag",
        description="flag: answer with query_attack=true; 403/429: refuse the client for the cool-down",
    )
    query_cooldown_s: float = Field(
        default=60.0, gt=0, description="how long a client flagged for a query attack is refused"
    )

    @field_validator("api_key", "admin_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: Any) -> Any:
        """An empty LAPGUARD_API_KEY (e.g. compose's ``${LAPGUARD_API_KEY:-}``) means no key; a
        key no header can carry exactly is refused, or it would lock every client out."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        if isinstance(value, str) and not (
            value == value.strip() and value.isascii() and value.isprintable()
        ):
            raise ValueError(
                "the key has surrounding whitespace (a secret file's trailing newline?) or "
                "characters that are not printable ASCII: no client could present it in a header"
            )
        return value

    @field_validator("image_formats")
    @classmethod
    def _readable_formats(cls, formats: tuple[str, ...]) -> tuple[str, ...]:
        """A format Pillow cannot open would fail every upload of another format with a 500."""
        return readable_formats(formats)

    @model_validator(mode="after")
    def _queue_holds_a_request(self) -> Settings:
        if self.max_queue < self.max_images_per_request:
            raise ValueError(
                f"max_queue ({self.max_queue}) must be at least max_images_per_request "
                f"({self.max_images_per_request}), or a full request could never be queued"
            )
        return self


#: Mean images per request from which a batch's forward pass takes every core when
#: ``torch_threads`` is unset: the event loop's work per image (reading, decoding, answering) is
#: then a small share of the network's, so a core kept for it would mostly idle.
LARGE_REQUEST_IMAGES = 8


def usable_cores() -> int:
    """The cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def default_torch_threads() -> int:
    """The forward pass's threads when ``torch_threads`` is unset, for batches of small
    requests: the usable cores less one (the event loop keeps a core)."""
    return max(1, usable_cores() - 1)


def adaptive_torch_threads(images: int, requests: int) -> int:
    """The forward pass's threads for a batch of ``images`` from ``requests`` requests when
    ``torch_threads`` is unset: every core for large requests (:data:`LARGE_REQUEST_IMAGES`
    images each on average), else :func:`default_torch_threads` (measured on 2 cores: 4 clients
    of 64-image requests gain ~1.4x with both cores; 32 single-image clients lose ~1.3x)."""
    if images >= LARGE_REQUEST_IMAGES * max(1, requests):
        return usable_cores()
    return default_torch_threads()


#: Variables of settings that no longer exist, and what replaced them: set, they would be ignored
#: without a word (pydantic-settings skips unknown variables), so start-up refuses them.
REMOVED_VARIABLES = {
    "LAPGUARD_QUERY_DISTANCE": "the query memory now compares quantized pixels: set "
    "LAPGUARD_QUERY_LEVELS (default 4) and LAPGUARD_QUERY_NEIGHBOURS (default 3)",
    "LAPGUARD_QUERY_EMBEDDING_DIM": "the query memory now stores quantized pixels, not an "
    "embedding: remove it (LAPGUARD_QUERY_LEVELS sets the quantization)",
}


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment with ``overrides`` (CLI flags; None means 'not given') on top."""
    removed = [f"{name}: {why}" for name, why in REMOVED_VARIABLES.items() if name in os.environ]
    if removed:
        raise ConfigError("settings that no longer exist are set; " + "; ".join(removed))
    given = {key: value for key, value in overrides.items() if value is not None}
    try:
        return Settings(**given)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
            for e in error.errors()
        )
        raise ConfigError(
            f"invalid service settings ({problems}); check the LAPGUARD_* variables and flags"
        ) from error
