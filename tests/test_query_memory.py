"""Stateful detection of query attacks (service/query_memory.py), in process and against a real
``redis-server`` this module starts on a free loopback port: a Square-like L-infinity query stream
(large squares of +-eps, eps = 0.03 and 0.1) and a near-duplicate stream (one clean image with
small noise, as HopSkipJump's probes) are flagged; distinct clean images, resends and JPEG
re-encodes are not; memory stays within its bound under a long stream."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from service.query_memory import (
    CHUNK,
    LABEL_MASK,
    InProcessStore,
    QueryEmbedder,
    QueryMemory,
    QueryStore,
    RedisStore,
    _neighbours,
    client_key,
    far_pixels,
    nearest_far_pixels,
)
from service.settings import Settings
from tests.service_helpers import near_duplicates, square_like
from training.data.datasets import load_dataset, to_arrays

DEFAULTS = Settings()
K = DEFAULTS.query_neighbours
PLANES = DEFAULTS.query_levels - 1
HISTORY = 512  # holds the whole distinct-image stream; the long stream (1000) wraps it


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embed() -> QueryEmbedder:
    return QueryEmbedder(
        (1, 28, 28), (0.0, 1.0), levels=DEFAULTS.query_levels, seed=DEFAULTS.query_seed
    )


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest, embed: QueryEmbedder) -> Iterator[QueryStore]:
    """A fresh store of each kind (a fresh key prefix per Redis test)."""
    if request.param == "memory":
        yield InProcessStore(history=HISTORY, max_clients=8, width=embed.width)
        return
    url = request.getfixturevalue("redis_url")
    redis_store = RedisStore(
        url, history=HISTORY, width=embed.width, ttl_s=60, prefix=f"test:{request.node.name}:"
    )
    yield redis_store
    redis_store.close()


@pytest.fixture(scope="module")
def clean_images(data_root: Path) -> np.ndarray:
    """1000 seeded Fashion-MNIST test images, float32 [N, 1, 28, 28] in [0, 1]."""
    images, _ = to_arrays(load_dataset("fashion-mnist", "test", root=data_root), 1000, seed=0)
    return images


def _memory(store: QueryStore) -> QueryMemory:
    return QueryMemory(store, neighbours=K, planes=PLANES)


def _signatures(embed: QueryEmbedder, images: np.ndarray) -> np.ndarray:
    return embed(torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)))


def _far_counts(query: np.ndarray, rows: np.ndarray) -> np.ndarray:
    far = far_pixels(query, rows, PLANES)
    return np.unpackbits(far.view(np.uint8), axis=1).sum(axis=1)


def _jpeg(image: np.ndarray) -> np.ndarray:
    buffer = io.BytesIO()
    Image.fromarray((image[0] * 255).round().astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return np.asarray(Image.open(buffer), dtype=np.float32)[None] / 255


# ---- the signature ------------------------------------------------------------------------------
def test_signature_layout_and_digest(embed: QueryEmbedder, clean_images: np.ndarray) -> None:
    rows = _signatures(embed, clean_images[:4])
    assert rows.dtype == np.uint64 and rows.shape == (4, 1 + 13 * PLANES)  # 784 pixels: 13 words
    again = _signatures(embed, clean_images[:4])
    assert np.array_equal(rows, again)  # deterministic
    nudged = clean_images[:1].copy()
    nudged[0, 0, 14, 14] = np.nextafter(nudged[0, 0, 14, 14], np.float32(2))
    changed = _signatures(embed, nudged)[0]
    assert changed[0] != rows[0, 0]  # the digest tells an exact resend from a nudged copy
    assert _far_counts(changed, rows[:1])[0] == 0  # ... which is still a neighbour


def test_the_label_sits_in_the_digests_low_bits(embed: QueryEmbedder, clean_images) -> None:
    batch = torch.from_numpy(clean_images[:3])
    plain = embed(batch)
    labelled = embed(batch, labels=np.array([7, 0, 65535 + 3]))
    assert np.array_equal(plain[:, 1:], labelled[:, 1:])
    assert np.array_equal(labelled[:, 0] & LABEL_MASK, [7, 0, 2])  # modulo 2**16
    assert np.array_equal(labelled[:, 0] & ~LABEL_MASK, plain[:, 0])
    assert len(set(plain[:, 0].tolist())) == 3  # the digest still tells the images apart


def test_levels_differing_by_two_are_far_pixels(embed: QueryEmbedder) -> None:
    """Level boundaries at 0.25, 0.5, 0.75: a pixel is far exactly when its levels differ by 2+."""
    base = np.zeros((1, 1, 28, 28), dtype=np.float32)
    values = {0.24: 0, 0.26: 0, 0.49: 0, 0.51: 1, 0.74: 1, 0.99: 1}  # far from 0.0? (level 0)
    for value, far in values.items():
        other = base.copy()
        other[0, 0, 3, 5] = value
        assert _far_counts(_signatures(embed, other)[0], _signatures(embed, base))[0] == far


def test_an_eps_ball_is_one_neighbourhood_and_clean_images_are_not(
    embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    """Any two points of an L-infinity ball of radius 1/(2*levels) around one image are
    neighbours; distinct clean images almost never are (recorded on the 10,000: 0.62%)."""
    rng = np.random.default_rng(0)
    eps = 0.5 / DEFAULTS.query_levels - 1e-3
    for image in clean_images[:20]:
        ball = np.clip(image + rng.uniform(-eps, eps, (30, *image.shape)), 0, 1)
        rows = _signatures(embed, ball)
        assert all(_far_counts(row, rows).max() == 0 for row in rows)
    nearest = nearest_far_pixels(_signatures(embed, clean_images), PLANES)
    assert np.mean(nearest == 0) < 0.01
    assert np.median(nearest) >= 10


# ---- the decision, in process and in Redis ------------------------------------------------------
@pytest.mark.parametrize("eps", [0.03, 0.1])
def test_a_square_like_stream_is_flagged(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray, eps: float
) -> None:
    queries = square_like(clean_images[3], 40, eps, seed=0)
    rms = np.sqrt(((queries[1:] - queries[:-1]) ** 2).mean(axis=(1, 2, 3)))
    if eps == 0.1:  # large squares: successive queries as far apart as distinct clean images
        assert np.median(rms) > 0.046
    memory = _memory(store)
    rows = _signatures(embed, queries)
    flags = np.concatenate([memory.observe("attacker", rows[i : i + 1]) for i in range(40)])
    assert not flags[:K].any()  # the first K queries cannot have K neighbours yet
    assert flags[K:].all()


def test_a_near_duplicate_stream_is_flagged(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    memory = _memory(store)
    probes = _signatures(embed, near_duplicates(clean_images[3], 40, 0.01, seed=0))
    flags = np.concatenate([memory.observe("attacker", probes[i : i + 1]) for i in range(40)])
    assert not flags[:K].any() and flags[K:].all()


def test_distinct_clean_images_resends_and_reencodes_are_not_flagged(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    memory = _memory(store)
    rows = _signatures(embed, clean_images[:300])
    flags = np.concatenate([memory.observe("benign", rows[i : i + 8]) for i in range(0, 300, 8)])
    assert flags.shape == (300,) and not flags.any()
    # an image, its JPEG q90 re-encode, then resends of both: one neighbour stored, resends free
    image = clean_images[400]
    copies = _signatures(embed, np.stack([image, _jpeg(image), image, _jpeg(image)]))
    assert not memory.observe("reencoder", copies).any()
    assert len(store.recent("reencoder")) == 2
    resent = np.repeat(rows[:1], 30, axis=0)
    assert not memory.observe("resender", resent).any()
    assert len(store.recent("resender")) == 1  # resends are not stored again


def test_a_neighbour_labelled_otherwise_flags_from_the_second_neighbour(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    """An image, then a near-duplicate the network labels otherwise (what an attack's first
    successful or boundary-crossing query is): one such flip may be a benign re-encode of an
    image on the boundary, so it flags once the query has 2 neighbours (the attack resending its
    candidate, or its next probe), long before K; same-label near-duplicates do not (below K),
    nor does another client's history."""
    memory = _memory(store)
    ball = near_duplicates(clean_images[3], 4, 0.01, seed=1)
    same = embed(torch.from_numpy(ball), labels=np.array([2, 2, 2, 2]))
    assert not memory.observe("calm", same[: K - 1]).any()
    original = embed(torch.from_numpy(ball[:1]), labels=np.array([2]))
    crossed = embed(torch.from_numpy(ball[1:2]), labels=np.array([5]))
    assert not memory.observe("attacker", original).any()
    assert not memory.observe("attacker", crossed).any()  # one neighbour: a re-encode may flip
    assert memory.observe("attacker", crossed).all()  # resent: two neighbours, one flipped
    assert not memory.observe("other", crossed).any()
    probes = embed(torch.from_numpy(ball[1:4]), labels=np.array([2, 6, 6]))  # one request
    assert memory.observe("batched", probes).tolist() == [False, False, True]


def test_a_neighbour_labelled_otherwise_is_remembered_past_a_chunk_of_decoys(
    embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    """The flipped neighbour found in one chunk of candidates still counts when a later chunk
    finds a same-label one: decoys that share the query's first pixel group but differ
    elsewhere (one chunk and more of them) must not hide the flip."""
    ball = near_duplicates(clean_images[3], 3, 0.01, seed=1)
    query, flipped, same = embed(torch.from_numpy(ball), labels=np.array([2, 5, 2]))
    decoys = np.repeat(query[None], CHUNK + 40, axis=0)
    decoys[:, 1 + PLANES :] = ~decoys[:, 1 + PLANES :]  # every later pixel far
    rows = np.concatenate([flipped[None], decoys, same[None]])
    assert _neighbours(query, rows, PLANES, K) == (2, True)


def test_a_request_is_compared_with_its_own_earlier_images(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    probes = _signatures(embed, square_like(clean_images[5], 16, 0.1, seed=2))
    flags = _memory(store).observe("batcher", probes)
    assert not flags[:K].any() and flags[K:].all()


def test_clients_are_separate(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    memory = _memory(store)
    probes = _signatures(embed, square_like(clean_images[7], 20, 0.1, seed=3))
    memory.observe("attacker", probes)
    assert memory.observe("attacker", probes[:1]).all()
    assert not memory.observe("other", probes[:1]).any()


def test_history_stays_bounded_under_a_long_stream(
    store: QueryStore, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    memory = _memory(store)
    rows = _signatures(embed, clean_images)
    for i in range(0, 1000, 8):
        memory.observe("long", rows[i : i + 8])
    recent = store.recent("long")
    assert recent.shape == (HISTORY, embed.width)
    assert rows[-1, 0] in recent[:, 0]  # the ring keeps the newest: the last image is stored


def test_blocks_expire(store: QueryStore) -> None:
    assert store.blocked_for("c") == 0.0
    store.block("c", 0.3)
    assert 0.0 < store.blocked_for("c") <= 0.3
    time.sleep(0.4)
    assert store.blocked_for("c") == 0.0


def _random_rows(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    return rng.integers(0, 2**63, (n, width), dtype=np.uint64)


def test_in_process_memory_is_bounded_in_clients_and_bytes(embed: QueryEmbedder) -> None:
    width, history, max_clients = embed.width, 50, 20
    store = InProcessStore(history=history, max_clients=max_clients, width=width)
    memory = QueryMemory(store, neighbours=10, planes=PLANES)
    rng = np.random.default_rng(0)
    for step in range(3000):  # 100 passing clients cycle through; "steady" comes back often
        memory.observe(f"client{step % 100}", _random_rows(rng, 4, width))
        if step % 10 == 0:
            memory.observe("steady", _random_rows(rng, 4, width))
    assert store.clients == max_clients
    assert store.nbytes <= max_clients * history * width * 8
    assert store.recent("steady").shape == (history, width)  # a recently seen client is kept
    assert store.recent("client99").shape == (4, width)  # evicted since its last visit, back
    assert store.recent("client0").shape == (0, width)  # the least recently seen were evicted


def test_redis_ring_is_bounded_in_bytes(redis_url: str, embed: QueryEmbedder) -> None:
    import redis

    width = embed.width
    store = RedisStore(redis_url, history=HISTORY, width=width, ttl_s=60, prefix="bound:")
    rng = np.random.default_rng(0)
    rows = _random_rows(rng, 1400, width)
    for i in range(0, 1400, 7):  # 1400 rows through a ring of HISTORY
        store.add("c", rows[i : i + 7])
    assert redis.Redis.from_url(redis_url).strlen("bound:ring:c") == HISTORY * width * 8
    assert np.array_equal(np.sort(store.recent("c")[:, 0]), np.sort(rows[-HISTORY:, 0]))
    store.close()


def test_client_key_hides_the_api_key() -> None:
    assert client_key(None, "10.0.0.1") == "addr:10.0.0.1"
    keyed = client_key("secret-key", "10.0.0.1")
    assert keyed.startswith("key:") and "secret" not in keyed
    assert keyed == client_key("secret-key", "10.0.0.2")


def test_a_redis_ring_evicted_without_its_counter_starts_over(
    redis_url: str, embed: QueryEmbedder, clean_images: np.ndarray
) -> None:
    """Under allkeys-lru Redis may evict a client's ring and keep its counter; the next write
    then landed past the end and padded the ring with zero rows (black images, label 0), which
    later flagged a distinct dark image. The ring now starts over with its counter."""
    import redis

    store = RedisStore(redis_url, history=HISTORY, width=embed.width, ttl_s=60, prefix="t-evict:")
    rows = _signatures(embed, clean_images[:40])
    store.add("c", rows)
    redis.Redis.from_url(redis_url).delete("t-evict:ring:c")
    store.add("c", rows[:1])
    recent = store.recent("c")
    assert len(recent) == 1 and np.array_equal(recent[0], rows[0])
