"""The query memory's calibration, bounds and cost.

Prints:
1. the benign calibration of the signature (``query_levels``) and of the neighbour rule
   (``query_neighbours``): for 3, 4 and 5 levels, quantiles of how many pixels set each of the
   10,000 distinct clean Fashion-MNIST test images apart from its closest other one (a neighbour
   has 0), and how many of them have at least k neighbours among the other 9,999 (a client that
   sends the whole test set); which copies benign users send (PNG resend, JPEG re-encode, 1-pixel
   crop, noise) are neighbours of their original;
2. bytes per client and the in-process bound at the default settings;
3. time per request of ``QueryMemory.observe`` (one image) against a client holding 10,000
   stored queries (clean training images; and, the slow case, 10,000 queries of one eps-ball),
   in process and (with ``--redis URL``) in Redis;
4. with ``--bundle B``: the latency a served single-image request gains from the check: two
   `lapguard serve` processes on the bundle, memory off vs in process with this client's history
   filled with 10,000 clean training images; requests alternate between them (medians of each).

    LAPGUARD_DATA=data python -m benchmarks.query_memory [--redis redis://127.0.0.1:6379/0]
        [--bundle runs/smoke/bundle]
    python -m benchmarks.query_memory --bundle BUNDLE --small   # 300 images, 20 rounds (tests)
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

from benchmarks import small
from benchmarks.local_server import start_server, stop_server
from service.query_memory import (
    InProcessStore,
    QueryEmbedder,
    QueryMemory,
    QueryStore,
    RedisStore,
    far_pixels,
    nearest_far_pixels,
)
from service.settings import Settings
from training.data.datasets import load_dataset, to_arrays

QUANTILES = (0.0001, 0.001, 0.01, 0.05, 0.5)
LEVELS = (3, 4, 5)


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


def _signatures(embed: QueryEmbedder, images: np.ndarray) -> np.ndarray:
    return embed(torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)))


def neighbour_counts(rows: np.ndarray, planes: int) -> np.ndarray:
    """For each signature, how many of the other (distinct-digest) rows are its neighbours."""
    counts = np.empty(len(rows), dtype=np.int64)
    for i, query in enumerate(rows):
        others = rows[rows[:, 0] != query[0]]
        counts[i] = int(np.count_nonzero(~far_pixels(query, others, planes).any(axis=1)))
    return counts


def calibration(settings: Settings, n: int | None) -> None:
    images, _ = to_arrays(load_dataset("fashion-mnist", "test"), n)
    first = images[:500]
    rng = np.random.default_rng(0)
    copies = {
        "PNG resend": _reencoded(first, "PNG"),
        "JPEG q90 re-encode": _reencoded(first, "JPEG"),
        "1-pixel crop + resize": _reencoded(first, "PNG", crop=1),
        "noise sigma 0.01": np.clip(first + rng.normal(0, 0.01, first.shape), 0, 1),
        "noise sigma 0.03": np.clip(first + rng.normal(0, 0.03, first.shape), 0, 1),
    }
    ks = (1, 2, 3, 5, 10)
    for levels in LEVELS:
        embed = QueryEmbedder((1, 28, 28), (0.0, 1.0), levels=levels, seed=settings.query_seed)
        planes = levels - 1
        rows = _signatures(embed, images)
        started = time.perf_counter()
        nearest = nearest_far_pixels(rows, planes)
        counts = neighbour_counts(rows, planes)
        print(
            f"levels {levels} (covers L-inf eps <= {0.5 / levels:.3f}), {len(rows)} clean test "
            f"images ({time.perf_counter() - started:.0f} s):"
        )
        print(
            "  pixels apart from the nearest other image, quantiles "
            + " / ".join(f"{q:g}: {np.quantile(nearest, q):.0f}" for q in QUANTILES)
            + f"; images with a neighbour: {np.count_nonzero(nearest == 0)}"
        )
        print(
            f"  images with >= k neighbours among the other {len(rows) - 1:,}: "
            + ", ".join(f"k={k}: {np.count_nonzero(counts >= k)}" for k in ks)
        )
        base = _signatures(embed, first)
        shares = []
        for name, copy in copies.items():
            rows_copy = _signatures(embed, copy)
            near = [
                not far_pixels(c, b[None], planes).any()
                for c, b in zip(rows_copy, base, strict=True)
            ]
            same = np.mean(rows_copy[:, 0] == base[:, 0])
            shares.append(f"{name} {100 * np.mean(near):.0f}% (exact {100 * same:.0f}%)")
        print("  copies that are neighbours of their original: " + "; ".join(shares))


def lookup_time(
    store: QueryStore, settings: Settings, stored: np.ndarray, queries: np.ndarray, repeats: int
) -> float:
    """Median seconds of one single-image ``observe`` with ``stored`` signatures in the history."""
    memory = QueryMemory(
        store, neighbours=settings.query_neighbours, planes=settings.query_levels - 1
    )
    store.add("bench", stored)
    times = []
    for i in range(repeats):
        query = queries[i % len(queries)][None]
        start = time.perf_counter()
        memory.observe("bench", query)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fill_history(url: str, images: np.ndarray) -> int:
    """Send ``images`` through /v2 (FP32, 64 a request); how many were flagged."""
    model = httpx.get(url + "/v1/model", timeout=10).json()["name"]
    flagged = 0
    for start in range(0, len(images), 64):
        x = np.ascontiguousarray(images[start : start + 64], dtype=np.float32)
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32"}]}
        body["inputs"][0]["data"] = x.ravel().tolist()
        response = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)
        response.raise_for_status()
        flags = [o["data"] for o in response.json()["outputs"] if o["name"] == "query_attack"]
        flagged += sum(flags[0])
    return flagged


def _check_seconds(url: str) -> tuple[float, float]:
    """(sum, count) of the server's query-check histogram."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("lapguard_query_check_duration_seconds_"):
            name, value = line.split()[:2]
            values[name] = float(value)
    prefix = "lapguard_query_check_duration_seconds_"
    return values[prefix + "sum"], values[prefix + "count"]


def served_latency(bundle: Path, stored: int, rounds: int, in_process: bool = False) -> None:
    """Median single-image /v1/predict latency without and with the check, interleaved (the
    servers in threads of this process with ``in_process``)."""
    common = {"LAPGUARD_MAX_QUEUE": "4096", "LAPGUARD_QUERY_HISTORY": str(stored)}
    off, off_url = start_server(bundle, flags=[], env={**common, "LAPGUARD_QUERY_MEMORY": "off"},
                                in_process=in_process)  # fmt: skip
    on, on_url = start_server(bundle, flags=[], env={**common, "LAPGUARD_QUERY_MEMORY": "memory"},
                              in_process=in_process)  # fmt: skip
    try:
        rng = np.random.default_rng(0)
        train, _ = to_arrays(load_dataset("fashion-mnist", "train"), stored, seed=0)
        flagged = _fill_history(on_url, train)
        print(f"history filled with {stored} clean training images ({flagged} of them flagged)")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis", default=None, help="also time a Redis store at this URL")
    parser.add_argument("--stored", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--bundle", type=Path, default=None, help="also time a served request")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--skip-calibration", action="store_true")
    parser.add_argument(
        "--calibration-images", type=int, default=None, help="the first N test images (all)"
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="seconds: 300 test images calibrate, 300 stored queries, 20 repeats and rounds, the "
        "servers in threads of this process",
    )
    return small.parse(parser, argv, calibration_images=300, stored=300, repeats=20, rounds=20)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    settings = Settings(query_history=args.stored)
    if not args.skip_calibration:
        calibration(settings, args.calibration_images)
    default = Settings()
    embed = QueryEmbedder(
        (1, 28, 28), (0.0, 1.0), levels=settings.query_levels, seed=settings.query_seed
    )
    row = embed.width * 8
    bound = default.query_max_clients * default.query_history * row
    print(
        f"bytes per query: {row}; per client: {default.query_history} x {row} = "
        f"{default.query_history * row}; in-process bound at defaults "
        f"({default.query_max_clients} clients): {bound / 2**20:.0f} MiB"
    )
    train, _ = to_arrays(load_dataset("fashion-mnist", "train"), args.stored, seed=0)
    test, _ = to_arrays(load_dataset("fashion-mnist", "test"), 500, seed=1)
    ball = np.clip(
        train[0] + np.random.default_rng(2).uniform(-0.1, 0.1, (args.stored, 1, 28, 28)), 0, 1
    )
    cases = {
        "clean training images": (_signatures(embed, train), _signatures(embed, test)),
        "one eps-ball (0.1), the slow case": (
            _signatures(embed, ball[1:]),
            _signatures(embed, ball[:1]),
        ),
    }
    for name, (stored, queries) in cases.items():
        store = InProcessStore(history=args.stored, max_clients=4, width=embed.width)
        seconds = lookup_time(store, settings, stored, queries, args.repeats)
        print(f"in-process observe, {args.stored} stored ({name}): median {seconds * 1e3:.3f} ms")
        if args.redis:
            redis_store = RedisStore(
                args.redis,
                history=args.stored,
                width=embed.width,
                ttl_s=60,
                prefix=f"bench:{time.time_ns()}:",  # a fresh key: no rows of an earlier run
            )
            seconds = lookup_time(redis_store, settings, stored, queries, args.repeats // 5)
            print(f"redis observe, {args.stored} stored ({name}): median {seconds * 1e3:.3f} ms")
            redis_store.close()
    if args.bundle:
        served_latency(args.bundle, args.stored, args.rounds, in_process=args.small)


if __name__ == "__main__":
    main()
