"""Stateful detection of query attacks (service/query_memory.py), in process and against a real
``redis-server`` this module starts on a free loopback port: a near-duplicate query stream (one
clean image with small noise, as HopSkipJump's probes) is flagged, distinct clean test images
and resends are not, and memory stays within its bound under a long stream."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from service.query_memory import (
    InProcessStore,
    QueryEmbedder,
    QueryMemory,
    QueryStore,
    RedisStore,
    calibrate_distance,
    client_key,
)
from service.settings import Settings
from tests.service_helpers import near_duplicates
from training.data import load_dataset, to_arrays

DEFAULTS = Settings()
HISTORY = 512  # holds the whole distinct-image stream; the long stream (1000) wraps it


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[QueryStore]:
    """A fresh store of each kind (a fresh key prefix per Redis test)."""
    dim = DEFAULTS.query_embedding_dim
    if request.param == "memory":
        yield InProcessStore(history=HISTORY, max_clients=8, dim=dim)
        return
    url = request.getfixturevalue("redis_url")
    redis_store = RedisStore(
        url, history=HISTORY, dim=dim, ttl_s=60, prefix=f"test:{request.node.name}:"
    )
    yield redis_store
    redis_store.close()


@pytest.fixture(scope="module")
def clean_images(data_root: Path) -> np.ndarray:
    """1000 seeded Fashion-MNIST test images, float32 [N, 1, 28, 28] in [0, 1]."""
    images, _ = to_arrays(load_dataset("fashion-mnist", "test", root=data_root), 1000, seed=0)
    return images


@pytest.fixture(scope="module")
def embed() -> QueryEmbedder:
    return QueryEmbedder(
        (1, 28, 28), (0.0, 1.0), dim=DEFAULTS.query_embedding_dim, seed=DEFAULTS.query_seed
    )


def _memory(store: QueryStore) -> QueryMemory:
    return QueryMemory(
        store, distance=DEFAULTS.query_distance, neighbours=DEFAULTS.query_neighbours
    )


# ---- the embedding ------------------------------------------------------------------------------
def test_embedding_distance_approximates_the_rms_pixel_distance(
    embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    a, b = clean_images[:200], clean_images[200:400]
    ea, eb = embed(torch.from_numpy(a)), embed(torch.from_numpy(b))
    rms = np.sqrt(((a - b) ** 2).reshape(200, -1).mean(axis=1))
    ratio = np.linalg.norm(ea - eb, axis=1) / rms
    assert abs(float(np.median(ratio)) - 1.0) < 0.1
    assert ea.dtype == np.float32 and ea.shape == (200, DEFAULTS.query_embedding_dim)


def test_the_default_distance_is_the_benign_calibration(
    embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    """The default sits below the nearest-neighbour distances of almost all distinct clean images
    (recorded calibration: 0.1% quantile over the 10,000 test images) and far above noisy copies."""
    embedded = embed(torch.from_numpy(clean_images))
    assert calibrate_distance(embedded, 0.01) > DEFAULTS.query_distance
    noisy = embed(torch.from_numpy(near_duplicates(clean_images[0], 20, 0.01, seed=1)))
    assert float(np.linalg.norm(noisy - embedded[0], axis=1).max()) < DEFAULTS.query_distance / 2


# ---- the decision, in process and in Redis ------------------------------------------------------
def test_a_near_duplicate_stream_is_flagged(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    memory = _memory(store)
    probes = embed(torch.from_numpy(near_duplicates(clean_images[3], 40, 0.01, seed=0)))
    flags = np.concatenate([memory.observe("attacker", probes[i : i + 1]) for i in range(40)])
    k = DEFAULTS.query_neighbours
    assert not flags[:k].any()  # the first k queries cannot have k neighbours yet
    assert flags[k:].all()


def test_distinct_clean_images_and_resends_are_not_flagged(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    memory = _memory(store)
    embedded = embed(torch.from_numpy(clean_images[:300]))
    flags = np.concatenate(
        [memory.observe("benign", embedded[i : i + 8]) for i in range(0, 300, 8)]
    )
    assert flags.shape == (300,) and not flags.any()
    resent = np.repeat(embedded[:1], 30, axis=0)
    assert not memory.observe("resender", resent).any()
    assert len(store.recent("resender")) == 1  # resends are not stored again


def test_a_request_is_compared_with_its_own_earlier_images(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    probes = embed(torch.from_numpy(near_duplicates(clean_images[5], 16, 0.01, seed=2)))
    flags = _memory(store).observe("batcher", probes)
    k = DEFAULTS.query_neighbours
    assert not flags[:k].any() and flags[k:].all()


def test_clients_are_separate(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    memory = _memory(store)
    probes = embed(torch.from_numpy(near_duplicates(clean_images[7], 20, 0.01, seed=3)))
    memory.observe("attacker", probes)
    assert memory.observe("attacker", probes[:1]).all()
    assert not memory.observe("other", probes[:1]).any()


def test_history_stays_bounded_under_a_long_stream(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    memory = _memory(store)
    embedded = embed(torch.from_numpy(clean_images))
    for i in range(0, 1000, 8):
        memory.observe("long", embedded[i : i + 8])
    recent = store.recent("long")
    assert recent.shape == (HISTORY, DEFAULTS.query_embedding_dim)
    # the ring keeps the newest: the last image is stored
    assert np.min(np.linalg.norm(recent - embedded[-1], axis=1)) < 1e-3


def test_blocks_expire(store: QueryStore) -> None:
    assert store.blocked_for("c") == 0.0
    store.block("c", 0.3)
    assert 0.0 < store.blocked_for("c") <= 0.3
    time.sleep(0.4)
    assert store.blocked_for("c") == 0.0


def test_in_process_memory_is_bounded_in_clients_and_bytes(embed: QueryEmbedder) -> None:
    dim, history, max_clients = DEFAULTS.query_embedding_dim, 50, 20
    store = InProcessStore(history=history, max_clients=max_clients, dim=dim)
    memory = QueryMemory(store, distance=DEFAULTS.query_distance, neighbours=10)
    rng = np.random.default_rng(0)
    for step in range(3000):  # 100 passing clients cycle through; "steady" comes back often
        memory.observe(f"client{step % 100}", rng.normal(0, 0.1, (4, dim)).astype(np.float32))
        if step % 10 == 0:
            memory.observe("steady", rng.normal(0, 0.1, (4, dim)).astype(np.float32))
    assert store.clients == max_clients
    assert store.nbytes <= max_clients * history * dim * 4
    assert store.recent("steady").shape == (history, dim)  # a recently seen client is kept
    assert store.recent("client99").shape == (4, dim)  # evicted since its last visit, back
    assert store.recent("client0").shape == (0, dim)  # the least recently seen were evicted


def test_redis_ring_is_bounded_in_bytes(redis_url: str) -> None:
    import redis

    dim = DEFAULTS.query_embedding_dim
    store = RedisStore(redis_url, history=HISTORY, dim=dim, ttl_s=60, prefix="bound:")
    rng = np.random.default_rng(0)
    for _ in range(200):  # 1400 rows through a ring of HISTORY
        store.add("c", rng.normal(0, 0.1, (7, dim)).astype(np.float32))
    assert redis.Redis.from_url(redis_url).strlen("bound:ring:c") == HISTORY * dim * 2
    store.close()


def test_client_key_hides_the_api_key() -> None:
    assert client_key(None, "10.0.0.1") == "addr:10.0.0.1"
    keyed = client_key("secret-key", "10.0.0.1")
    assert keyed.startswith("key:") and "secret" not in keyed
    assert keyed == client_key("secret-key", "10.0.0.2")
