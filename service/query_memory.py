"""Stateful detection of query-based black-box attacks (HopSkipJump, Boundary, Square, ...).

Such attacks send hundreds of near-duplicate queries; benign clients rarely do (Chen, Carlini &
Wagner 2019; Blacklight 2022). Each scored image gets a compact embedding (:class:`QueryEmbedder`:
a salted random projection of the prepared input, so Euclidean distance between two embeddings
approximates the RMS pixel distance of the two images, in units of the value range; no second
forward pass). :class:`QueryMemory` keeps, per client, a bounded history of recent embeddings in a
:class:`QueryStore` (in process, or Redis for several replicas) and flags a query that has at
least ``neighbours`` stored queries within ``distance`` of it. ``distance`` is calibrated on
benign traffic with :func:`calibrate_distance` (a low quantile of the nearest-neighbour distances
between distinct clean images). Exact resends (within ``duplicate_distance``) are not stored
again, so a client resending the same image does not build up a cluster of its own.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from service.errors import ServiceError

logger = logging.getLogger("lapguard.service")

#: Larger inputs are average-pooled to at most this side before the projection (bounds its size).
MAX_SIDE = 32
#: Embeddings are computed in float32; Redis stores them as float16 (2 bytes a number) to halve
#: the traffic, the in-process store as float32 (no conversion on the lookup's hot path).
REDIS_DTYPE = np.float16


class QueryStoreError(ServiceError):
    """The query store cannot be reached (e.g. Redis is down); the query is served unflagged."""


class QueryEmbedder:
    """Images ``[N, C, H, W]`` in ``value_range`` -> float32 ``[N, dim]``; the Euclidean distance
    between two embeddings approximates the RMS difference of the two images (value range = 1)."""

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        value_range: tuple[float, float],
        *,
        dim: int,
        seed: int,
    ) -> None:
        channels, height, width = input_shape
        self.pooled = (min(height, MAX_SIDE), min(width, MAX_SIDE))
        self.low, self.span = float(value_range[0]), float(value_range[1] - value_range[0])
        pixels = channels * self.pooled[0] * self.pooled[1]
        generator = torch.Generator().manual_seed(seed)
        # E||P^T v||^2 = ||v||^2 / pixels: the projection of a difference has the RMS as its norm.
        self.projection = torch.randn(pixels, dim, generator=generator) / (dim * pixels) ** 0.5
        self.dim = dim

    def __call__(self, batch: torch.Tensor) -> np.ndarray:
        x = (batch.detach().to("cpu", torch.float32) - self.low) / self.span
        if tuple(x.shape[-2:]) != self.pooled:
            x = torch.nn.functional.adaptive_avg_pool2d(x, self.pooled)
        return (x.flatten(1) @ self.projection).numpy()


class QueryStore(ABC):
    """Per-client bounded history of query embeddings, and client blocks with an expiry."""

    #: True when calls do network I/O (the service then calls them off the event loop).
    blocking = False

    @abstractmethod
    def recent(self, client: str) -> np.ndarray:
        """The client's stored embeddings ``[n, dim]`` (n <= history), any order."""

    @abstractmethod
    def add(self, client: str, embeddings: np.ndarray) -> None:
        """Store ``embeddings`` ``[m, dim]``; the oldest beyond the history length are dropped."""

    @abstractmethod
    def block(self, client: str, seconds: float) -> None:
        """Refuse the client for ``seconds``."""

    @abstractmethod
    def blocked_for(self, client: str) -> float:
        """Seconds the client stays blocked (0 when it is not)."""

    def close(self) -> None:  # noqa: B027 - optional: only stores with connections override it
        """Release connections."""


class _Ring:
    """A fixed-capacity ring of float32 rows, grown by doubling up to the capacity."""

    def __init__(self, capacity: int, dim: int) -> None:
        self.capacity = capacity
        self.rows = np.empty((min(capacity, 16), dim), dtype=np.float32)
        self.count = 0
        self.next = 0

    def extend(self, embeddings: np.ndarray) -> None:
        for row in embeddings[-self.capacity :]:
            if self.next == len(self.rows) and len(self.rows) < self.capacity:
                size = min(2 * len(self.rows), self.capacity)
                grown = np.empty((size, self.rows.shape[1]), dtype=np.float32)
                grown[: len(self.rows)] = self.rows
                self.rows = grown
            self.rows[self.next] = row
            self.next = (self.next + 1) % self.capacity
            self.count = min(self.count + 1, self.capacity)

    def view(self) -> np.ndarray:
        return self.rows[: self.count]


class InProcessStore(QueryStore):
    """One process's memory: at most ``max_clients`` clients (least recently seen evicted), each
    with at most ``history`` embeddings: ``max_clients * history * dim * 4`` bytes of rows."""

    def __init__(self, *, history: int, max_clients: int, dim: int) -> None:
        self.history, self.max_clients, self.dim = history, max_clients, dim
        self._rings: OrderedDict[str, _Ring] = OrderedDict()
        self._blocked: dict[str, float] = {}
        self._lock = threading.Lock()

    def recent(self, client: str) -> np.ndarray:
        with self._lock:
            ring = self._rings.get(client)
            if ring is None:
                return np.empty((0, self.dim), dtype=np.float32)
            self._rings.move_to_end(client)
            return ring.view()

    def add(self, client: str, embeddings: np.ndarray) -> None:
        if len(embeddings) == 0:
            return
        with self._lock:
            ring = self._rings.get(client)
            if ring is None:
                ring = self._rings[client] = _Ring(self.history, self.dim)
                while len(self._rings) > self.max_clients:
                    self._rings.popitem(last=False)
            self._rings.move_to_end(client)
            ring.extend(embeddings)

    def block(self, client: str, seconds: float) -> None:
        with self._lock:
            now = time.monotonic()
            if len(self._blocked) >= self.max_clients:  # bounded: drop expired blocks first
                self._blocked = {c: t for c, t in self._blocked.items() if t > now}
            self._blocked[client] = now + seconds

    def blocked_for(self, client: str) -> float:
        until = self._blocked.get(client)
        return 0.0 if until is None else max(0.0, until - time.monotonic())

    @property
    def clients(self) -> int:
        return len(self._rings)

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored rows (the bound: ``max_clients * history * dim * 4``)."""
        return sum(ring.rows.nbytes for ring in self._rings.values())


#: Writes rows into a client's ring (one string, ``history`` slots of ``width`` bytes) at the slots
#: its counter gives, and refreshes both keys' expiry: one round trip, atomic across replicas.
_RING_APPEND = """
local width, history, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local first = redis.call('INCRBY', KEYS[2], #ARGV - 3) - (#ARGV - 3)
for i = 4, #ARGV do
  redis.call('SETRANGE', KEYS[1], ((first + i - 4) % history) * width, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
"""


class RedisStore(QueryStore):
    """Histories shared by several replicas: per client a ring of float16 rows in one Redis string
    (read in one GET), written by a Lua script, expiring after ``ttl_s`` idle, and a key with a TTL
    per blocked client. The Redis server bounds the number of clients (``maxmemory`` with
    ``allkeys-lru``); all replicas must share ``query_seed`` and ``query_embedding_dim``."""

    blocking = True

    def __init__(self, url: str, *, history: int, dim: int, ttl_s: float, prefix: str) -> None:
        import redis

        self._redis = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._append = self._redis.register_script(_RING_APPEND)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.history, self.dim, self.ttl_ms = history, dim, int(ttl_s * 1000)
        self.width = dim * np.dtype(REDIS_DTYPE).itemsize
        self.prefix = prefix

    def _key(self, kind: str, client: str) -> str:
        return f"{self.prefix}{kind}:{client}"

    def recent(self, client: str) -> np.ndarray:
        try:
            raw = bytes(self._redis.get(self._key("ring", client)) or b"")  # type: ignore[arg-type]
        except self._errors as error:
            raise QueryStoreError(f"the query store is unreachable: {error}") from error
        usable = min(len(raw) // self.width, self.history) * self.width
        rows = np.frombuffer(raw[:usable], dtype=REDIS_DTYPE).reshape(-1, self.dim)
        return rows.astype(np.float32)

    def add(self, client: str, embeddings: np.ndarray) -> None:
        if len(embeddings) == 0:
            return
        rows = [row.astype(REDIS_DTYPE).tobytes() for row in embeddings[-self.history :]]
        keys = [self._key("ring", client), self._key("count", client)]
        try:
            self._append(keys=keys, args=[self.width, self.history, self.ttl_ms, *rows])
        except self._errors as error:
            raise QueryStoreError(f"the query store is unreachable: {error}") from error

    def block(self, client: str, seconds: float) -> None:
        try:
            self._redis.set(self._key("blocked", client), b"1", px=max(1, int(seconds * 1000)))
        except self._errors as error:
            raise QueryStoreError(f"the query store is unreachable: {error}") from error

    def blocked_for(self, client: str) -> float:
        try:
            left = int(self._redis.pttl(self._key("blocked", client)))
        except self._errors as error:
            raise QueryStoreError(f"the query store is unreachable: {error}") from error
        return max(0, left) / 1000.0

    def close(self) -> None:
        self._redis.close()


@dataclass(frozen=True)
class QueryMemory:
    """The decision: a query is part of an attack when at least ``neighbours`` of the client's
    stored queries lie within ``distance`` of it (RMS pixel distance, value range = 1)."""

    store: QueryStore
    distance: float
    neighbours: int
    duplicate_distance: float = 1e-4

    def observe(self, client: str, embeddings: np.ndarray) -> np.ndarray:
        """Flags (bool ``[N]``) of a request's queries, in order; then remembers them (each query
        is also compared with the earlier ones of the same request). Exact resends are counted
        as neighbours but not stored again."""
        history = self.store.recent(client)
        queries = np.asarray(embeddings, dtype=np.float32)
        flags = np.zeros(len(queries), dtype=bool)
        keep = np.zeros(len(queries), dtype=bool)
        for i, query in enumerate(queries):
            near = np.concatenate(
                [_distances(query, history), _distances(query, queries[:i][keep[:i]])]
            )
            flags[i] = int(np.count_nonzero(near <= self.distance)) >= self.neighbours
            keep[i] = not bool(np.any(near <= self.duplicate_distance))
        self.store.add(client, queries[keep])
        return flags


def _distances(query: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Euclidean distances of one embedding to each row (differences first: exact near 0)."""
    difference = rows - query
    return np.sqrt(np.einsum("ij,ij->i", difference, difference))


def calibrate_distance(embeddings: np.ndarray, quantile: float, *, chunk: int = 1024) -> float:
    """The ``quantile`` of the nearest-neighbour distances among distinct clean images (each
    image's closest other image, exact duplicates left out): the benign baseline of ``distance``."""
    x = np.asarray(embeddings, dtype=np.float64)
    norms = (x * x).sum(axis=1)
    nearest = np.empty(len(x))
    for start in range(0, len(x), chunk):
        block = x[start : start + chunk]
        squared = norms[start : start + chunk, None] + norms[None, :] - 2.0 * block @ x.T
        d = np.sqrt(np.maximum(squared, 0.0))  # float64: exact enough to tell duplicates
        d[d <= 1e-6] = np.inf  # itself and exact duplicates
        nearest[start : start + chunk] = d.min(axis=1)
    return float(np.quantile(nearest[np.isfinite(nearest)], quantile))


def client_key(api_key: str | None, address: str | None) -> str:
    """Who a query comes from: a digest of the API key it presented, else its address."""
    if api_key:
        return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:24]
    return f"addr:{address or 'unknown'}"
