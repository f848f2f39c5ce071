"""Service throughput and latency against the in-process Guard, in one run.

    python -m benchmarks.service_throughput --bundle runs/quick/bundle [--device cpu]
    python -m benchmarks.service_throughput --bundle BUNDLE --small   # a second of load (tests)

Prints:
  * in-process Guard throughput (images/s) at each batch size and the best one;
  * the detector's share of the Guard's batch time at batch 256 (target <= 10%);
  * in-process single-image latency (decode + prepare + predict of one PNG, no HTTP);
  * service throughput with 32 concurrent single-image clients (multipart POST /v1/predict) and
    its ratio to the best in-process throughput (target >= 0.8), with p50/p99 latency under that
    load;
  * the latency of one client sending single images one after another, p50 / in-process
    single-image latency (target <= 2): what one request costs when it is not queued behind 31
    others (under load, p50 >= clients / throughput whatever the server does).

The server is `lapguard serve` in a subprocess on 127.0.0.1 (a free port). The load generator is
`wrk` (C, so that it takes little of the cores the server needs; installed with apt-get when
missing), or httpx in this process with ``--load-generator httpx``; either sends one PNG per
request, the same one, and is bounded by --time-limit (and --requests for httpx). Benchmark alone: other jobs on the cores skew everything.
``--small`` (the tests) serves in a thread of this process, for a second of 4 clients, with httpx
when ``wrk`` is not installed (it never installs it).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time

import httpx
import numpy as np
import torch
from PIL import Image

from benchmarks import small
from benchmarks.httpx_load import run_httpx
from benchmarks.local_server import Server, start_server, stop_server
from benchmarks.server_load import add_server_load_flags, ensure_load_generator
from benchmarks.wrk_load import run_wrk
from detector.guard import Guard
from detector.images import decode_image


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="measured requests (after warm-up)")
    p.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds for the measured load phase"
    )
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256", help="in-process batch sizes")
    p.add_argument("--max-wait-ms", type=float, default=0.0, help="server micro-batch wait")
    p.add_argument(
        "--seconds-per-size", type=float, default=2.0, help="in-process timing budget per size"
    )
    p.add_argument(
        "--single-client-seconds", type=float, default=10.0, help="seconds of the one-client phase"
    )
    add_server_load_flags(p, device="auto", warmup=5.0, servers="the server")
    p.add_argument(
        "--small",
        action="store_true",
        help="seconds: batches 1 and 8, 4 clients for 1 s, 1 torch thread, the server in a "
        "thread of this process, httpx unless wrk is installed",
    )
    return small.parse(p, argv, batch_sizes="1,8", seconds_per_size=0.05, clients=4, requests=500,
                       time_limit=1.0, single_client_seconds=1.0, warmup=0.5,
                       load_generator=small.httpx_unless_wrk, one_torch_thread=True)  # fmt: skip


def sample_pngs(guard: Guard, n: int, seed: int = 0) -> list[bytes]:
    """Seeded images in the model's input shape, PNG-encoded (what clients send)."""
    spec = guard.input_spec
    rng = np.random.default_rng(seed)
    shape = (
        (spec.height, spec.width)
        if spec.channels == 1
        else (spec.height, spec.width, spec.channels)
    )
    blobs = []
    for _ in range(n):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(buffer, "PNG")
        blobs.append(buffer.getvalue())
    return blobs


def timed(fn, budget: float, min_reps: int = 10, warmup: int = 3) -> list[float]:
    """Seconds per call of ``fn`` after ``warmup`` calls: at least ``min_reps``, up to ``budget`` s."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < min_reps or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if len(times) >= 10_000:
            break
    return times


def guard_features(guard: Guard, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the Guard's detector reads of ``x``, computed as ``Guard.predict`` does: every
    feature group the bundle ships (not only the transport features), and the predicted classes."""
    with torch.inference_mode(), guard._extractor as fx:
        logits = guard.model(x.to(guard.device, torch.float32))
        return fx.features(), logits.argmax(dim=1)


def in_process(guard: Guard, blobs: list[bytes], sizes: list[int], budget: float) -> dict:
    arrays = [decode_image(b, max_pixels=1 << 24) for b in blobs]
    pool = guard.prepare(arrays)
    throughput = {}
    for size in sizes:
        x = pool[np.arange(size) % len(pool)]
        times = timed(lambda x=x: guard.predict(x), budget)
        throughput[size] = size / statistics.median(times)
    # detector share at batch 256: the detector module alone on precomputed features
    x256 = pool[np.arange(256) % len(pool)]
    f, labels = guard_features(guard, x256)

    def detector_only() -> None:
        with torch.inference_mode():
            guard.detector_module(f, labels)
            if guard.device.type == "cuda":
                torch.cuda.synchronize()

    detector_time = statistics.median(timed(detector_only, budget))
    guard_time = statistics.median(timed(lambda: guard.predict(x256), budget))
    # single image, the per-request work without HTTP: decode + prepare + predict
    single = timed(
        lambda: guard.predict_images([decode_image(blobs[0], max_pixels=1 << 24)]),
        budget,
        min_reps=20,
    )
    return {
        "throughput": throughput,
        "detector_share_256": detector_time / guard_time,
        "detector_ms_256": detector_time * 1000,
        "guard_ms_256": guard_time * 1000,
        "single_ms": statistics.median(single) * 1000,
    }


def start_local_server(args: argparse.Namespace) -> tuple[Server, str]:
    flags = [
        "--device",
        args.device,
        "--max-batch-size",
        str(args.max_batch_size),
        "--max-wait-ms",
        str(args.max_wait_ms),
    ]
    env = {"LAPGUARD_MAX_QUEUE": str(max(512, 4 * args.clients))}
    return start_server(args.bundle, flags=flags, env=env, in_process=args.small)


def multipart_png(blob: bytes) -> tuple[bytes, str]:
    """The body and content type of a request of one PNG, multipart (as a browser or `curl -F`
    sends it): what either load generator POSTs to /v1/predict."""
    request = httpx.Request("POST", "/", files={"files": ("x.png", blob, "image/png")})
    return request.read(), request.headers["content-type"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    guard = Guard.from_bundle(args.bundle, device=args.device)
    blobs = sample_pngs(guard, 256)
    print(f"bundle {args.bundle} ({guard.manifest.name if guard.manifest else '?'}) on {guard.device}, "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")  # fmt: skip
    local = in_process(guard, blobs, sizes, args.seconds_per_size)
    for size, rate in local["throughput"].items():
        print(f"  in-process batch {size:4d}: {rate:9.1f} images/s")
    best_size, best = max(local["throughput"].items(), key=lambda kv: kv[1])
    print(f"in-process best: {best:.1f} images/s at batch {best_size}")
    print(
        f"detector share at batch 256: {local['detector_share_256']:.1%} "
        f"({local['detector_ms_256']:.2f} ms of {local['guard_ms_256']:.2f} ms)  target <= 10%"
    )
    print(f"in-process single-image latency (decode+prepare+predict): {local['single_ms']:.2f} ms")
    del guard

    generator = args.load_generator
    ensure_load_generator(args, servers="the server")
    body, content_type = multipart_png(blobs[0])
    process, url = start_local_server(args)
    try:
        predict = url + "/v1/predict"

        def measure(clients: int, seconds: float) -> dict[str, float]:
            if generator == "wrk":
                return run_wrk(predict, body, content_type, clients=clients, seconds=seconds)
            return run_httpx(predict, body, content_type, clients=clients, seconds=seconds,
                             requests=args.requests, warmup=args.warmup)  # fmt: skip

        measure(args.clients, args.warmup)  # warm-up: connections, batcher, allocator
        before = httpx.get(url + "/metrics", timeout=5).text
        loaded = measure(args.clients, args.time_limit)
        after = httpx.get(url + "/metrics", timeout=5).text
        single = measure(1, args.single_client_seconds)
    finally:
        stop_server(process)
    batches = _metric(after, "lapguard_batch_size_count") - _metric(
        before, "lapguard_batch_size_count"
    )
    images = _metric(after, "lapguard_batch_size_sum") - _metric(before, "lapguard_batch_size_sum")
    rate = loaded["rate"]
    print(
        f"service ({generator}): {loaded['requests']:.0f} requests in {args.time_limit:.0f} s with "
        f"{args.clients} clients ({loaded['errors']:.0f} errors), mean micro-batch "
        f"{images / max(batches, 1):.1f} images"
    )
    print(
        f"service throughput: {rate:.1f} images/s; ratio to in-process best {rate / best:.2f}  target >= 0.8"
    )
    print(
        f"service latency with {args.clients} clients: p50 {loaded['p50']:.2f} ms, p99 {loaded['p99']:.2f} ms"
    )
    print(
        f"one client, one image per request: {single['rate']:.1f} requests/s, p50 {single['p50']:.2f} ms, "
        f"p99 {single['p99']:.2f} ms; p50 / in-process single {single['p50'] / local['single_ms']:.2f}  target <= 2"
    )


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


if __name__ == "__main__":
    main()
