"""The query memory's calibration, bounds and cost (issue 12, item 3).

Prints:
1. the near-duplicate distance calibrated on benign traffic: quantiles of the nearest-neighbour
   distances (RMS pixels, value range = 1) between the 10,000 distinct clean Fashion-MNIST test
   images, in the default embedding (dim 64, seed 0), next to the exact pixel-space figures,
   and the distances of the copies benign users send (PNG resend, JPEG re-encode, 1-pixel crop)
   and of noisy copies (as HopSkipJump's gradient probes);
2. bytes per client and the in-process bound at the default settings;
3. time per request of ``QueryMemory.observe`` (one image) against a client holding 10,000
   stored queries, in process and (with ``--redis URL``) in Redis.

    LAPGUARD_DATA=data .venv/bin/python benchmarks/query_memory.py [--redis redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np
import torch
from PIL import Image

from service.query_memory import (
    InProcessStore,
    QueryEmbedder,
    QueryMemory,
    QueryStore,
    RedisStore,
    calibrate_distance,
)
from service.settings import Settings
from training.data import load_dataset, to_arrays

QUANTILES = (0.0001, 0.001, 0.01, 0.05, 0.5)


def _reencoded(images: np.ndarray, fmt: str, crop: int = 0) -> np.ndarray:
    out = []
    for image in images:
        pil = Image.fromarray((image[0] * 255).round().astype(np.uint8))
        if crop:
            pil = pil.crop((crop, crop, 28 - crop, 28 - crop)).resize((28, 28), Image.BILINEAR)
        buffer = io.BytesIO()
        pil.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        out.append(np.asarray(Image.open(buffer), dtype=np.float32)[None] / 255)
    return np.stack(out)


def calibration(settings: Settings) -> None:
    images, _ = to_arrays(load_dataset("fashion-mnist", "test"))
    embed = QueryEmbedder(
        (1, 28, 28), (0.0, 1.0), dim=settings.query_embedding_dim, seed=settings.query_seed
    )
    embedded = embed(torch.from_numpy(images))
    exact = images.reshape(len(images), -1) / np.sqrt(28 * 28)
    print(f"clean NN distance quantiles over {len(images)} test images:")
    for q in QUANTILES:
        print(
            f"  q={q:<7} embedding {calibrate_distance(embedded, q):.4f}   pixels {calibrate_distance(exact, q):.4f}"
        )
    first = images[:500]
    base = embed(torch.from_numpy(first)).astype(np.float32)
    rng = np.random.default_rng(0)
    copies = {
        "PNG resend": _reencoded(first, "PNG"),
        "JPEG q90 re-encode": _reencoded(first, "JPEG"),
        "1-pixel crop + resize": _reencoded(first, "PNG", crop=1),
        "noise sigma 0.01": np.clip(first + rng.normal(0, 0.01, first.shape), 0, 1),
        "noise sigma 0.03": np.clip(first + rng.normal(0, 0.03, first.shape), 0, 1),
    }
    print("median distance of a copy to its original (embedding):")
    for name, copy in copies.items():
        e = embed(torch.from_numpy(copy.astype(np.float32))).astype(np.float32)
        print(f"  {name:<24} {np.median(np.linalg.norm(e - base, axis=1)):.4f}")


def lookup_time(store: QueryStore, settings: Settings, stored: int, repeats: int) -> float:
    """Median seconds of one single-image ``observe`` with ``stored`` queries in the history."""
    rng = np.random.default_rng(1)
    dim = settings.query_embedding_dim
    memory = QueryMemory(
        store, distance=settings.query_distance, neighbours=settings.query_neighbours
    )
    store.add("bench", (rng.normal(0, 0.05, (stored, dim))).astype(np.float16))
    times = []
    for _ in range(repeats):
        query = rng.normal(0, 0.05, (1, dim)).astype(np.float16)
        start = time.perf_counter()
        memory.observe("bench", query)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis", default=None, help="also time a Redis store at this URL")
    parser.add_argument("--stored", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = Settings(query_history=args.stored)
    calibration(settings)
    per_client = settings.query_history * settings.query_embedding_dim * 4
    default = Settings()
    bound = default.query_max_clients * default.query_history * default.query_embedding_dim * 4
    print(
        f"bytes per client (float32 rows): {default.query_history} x {default.query_embedding_dim} x 4 = "
        f"{default.query_history * default.query_embedding_dim * 4}; in-process bound at defaults "
        f"({default.query_max_clients} clients): {bound / 2**20:.0f} MiB"
    )
    store = InProcessStore(history=args.stored, max_clients=4, dim=settings.query_embedding_dim)
    seconds = lookup_time(store, settings, args.stored, args.repeats)
    print(
        f"in-process observe, {args.stored} stored ({per_client / 2**20:.2f} MiB): "
        f"median {seconds * 1e3:.3f} ms"
    )
    if args.redis:
        redis_store = RedisStore(
            args.redis,
            history=args.stored,
            dim=settings.query_embedding_dim,
            ttl_s=60,
            prefix="bench:",
        )
        seconds = lookup_time(redis_store, settings, args.stored, args.repeats // 5)
        print(f"redis observe, {args.stored} stored: median {seconds * 1e3:.3f} ms")
        redis_store.close()


if __name__ == "__main__":
    main()
