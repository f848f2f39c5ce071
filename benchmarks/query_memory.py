"""The query memory's calibration, bounds and cost (issue 12, item 3).

Prints:
1. the near-duplicate distance calibrated on benign traffic: quantiles of the nearest-neighbour
   distances (RMS pixels, value range = 1) between the 10,000 distinct clean Fashion-MNIST test
   images, in the default embedding (dim 64, seed 0), next to the exact pixel-space figures,
   and the distances of the copies benign users send (PNG resend, JPEG re-encode, 1-pixel crop)
   and of noisy copies (as HopSkipJump's gradient probes); and the distance to the k-th nearest
   same-class image (k = query_neighbours), the benign tail of the k-neighbour rule;
2. bytes per client and the in-process bound at the default settings;
3. time per request of ``QueryMemory.observe`` (one image) against a client holding 10,000
   stored queries, in process and (with ``--redis URL``) in Redis;
4. with ``--bundle B``: the latency a served single-image request gains from the check: two
   `lapguard serve` processes on the bundle, memory off vs in process with this client's history
   filled with 10,000 stored queries; requests alternate between them (medians of each).

    LAPGUARD_DATA=data .venv/bin/python benchmarks/query_memory.py [--redis redis://127.0.0.1:6379/0]
        [--bundle runs/smoke/bundle]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import httpx
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_server import start_server, stop_server  # noqa: E402

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
    images, labels = to_arrays(load_dataset("fashion-mnist", "test"))
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
    k = settings.query_neighbours
    kth = []
    for label in np.unique(labels):  # the densest benign client: one class only
        same = embedded[labels == label].astype(np.float64)
        squared = (same * same).sum(1)
        d = np.sqrt(np.maximum(squared[:, None] + squared[None, :] - 2 * same @ same.T, 0.0))
        d[d <= 1e-6] = np.inf
        kth.append(np.sort(d, axis=1)[:, k - 1])
    print(f"distance to the {k}th-nearest same-class test image (~1000 a class), quantiles:")
    print("  " + "   ".join(f"q={q} {np.quantile(np.concatenate(kth), q):.4f}" for q in QUANTILES))
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


def _fill_history(url: str, stored: int, rng: np.random.Generator) -> None:
    """Send ``stored`` distinct random images through /v2 (FP32, 64 a request)."""
    model = httpx.get(url + "/v1/model", timeout=10).json()["name"]
    for start in range(0, stored, 64):
        x = rng.random((min(64, stored - start), 1, 28, 28), dtype=np.float32)
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32"}]}
        body["inputs"][0]["data"] = x.ravel().tolist()
        response = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)
        response.raise_for_status()
        flags = [o["data"] for o in response.json()["outputs"] if o["name"] == "query_attack"]
        assert not any(flags[0]), "random filler images were flagged"


def _check_seconds(url: str) -> tuple[float, float]:
    """(sum, count) of the server's query-check histogram."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("lapguard_query_check_duration_seconds_"):
            name, value = line.split()[:2]
            values[name] = float(value)
    prefix = "lapguard_query_check_duration_seconds_"
    return values[prefix + "sum"], values[prefix + "count"]


def served_latency(bundle: Path, stored: int, rounds: int) -> None:
    """Median single-image /v1/predict latency without and with the check, interleaved."""
    common = {"LAPGUARD_MAX_QUEUE": "4096", "LAPGUARD_QUERY_HISTORY": str(stored)}
    off, off_url = start_server(bundle, flags=[], env={**common, "LAPGUARD_QUERY_MEMORY": "off"})
    on, on_url = start_server(bundle, flags=[], env={**common, "LAPGUARD_QUERY_MEMORY": "memory"})
    try:
        rng = np.random.default_rng(0)
        _fill_history(on_url, stored, rng)
        before = _check_seconds(on_url)
        times: dict[str, list[float]] = {off_url: [], on_url: []}
        with httpx.Client(timeout=30) as client:
            for i in range(rounds):
                image = (rng.random((28, 28)) * 255).astype(np.uint8)
                buffer = io.BytesIO()
                Image.fromarray(image).save(buffer, "PNG")
                files = {"files": ("x.png", buffer.getvalue(), "image/png")}
                for url in (off_url, on_url) if i % 2 == 0 else (on_url, off_url):
                    start = time.perf_counter()
                    response = client.post(url + "/v1/predict", files=files)
                    times[url].append(time.perf_counter() - start)
                    response.raise_for_status()
        without, with_check = (statistics.median(times[u]) * 1e3 for u in (off_url, on_url))
        print(
            f"served single-image latency, {rounds} interleaved rounds, {stored} stored queries: "
            f"off {without:.3f} ms, on {with_check:.3f} ms, added {with_check - without:+.3f} ms (medians)"
        )
        total, count = (a - b for a, b in zip(_check_seconds(on_url), before, strict=True))
        print(
            f"in-server check (lapguard_query_check_duration_seconds) of those {count:.0f} requests: "
            f"mean {total / count * 1e3:.3f} ms"
        )
    finally:
        stop_server(off)
        stop_server(on)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis", default=None, help="also time a Redis store at this URL")
    parser.add_argument("--stored", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--bundle", type=Path, default=None, help="also time a served request")
    parser.add_argument("--rounds", type=int, default=400)
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
    if args.bundle:
        served_latency(args.bundle, args.stored, args.rounds)


if __name__ == "__main__":
    main()
