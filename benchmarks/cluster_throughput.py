"""Throughput of two `lapguard serve` replicas behind nginx against one, in one run.

    python -m benchmarks.cluster_throughput --bundle runs/quick/bundle [--device cpu]
    python -m benchmarks.cluster_throughput --bundle BUNDLE --small   # a second of load (tests)

Two replicas (benchmarks/cluster.py) behind one nginx that serves two ports: one balances
replica A alone, the other A and B. The load generator of benchmarks/service_throughput.py (wrk,
installed when missing, or httpx with ``--load-generator httpx``) POSTs one PNG per request to
/v1/predict through either port, the two interleaved over ``--rounds`` so that drift on the
machine falls on both. Prints each round, the median rates and latencies, and the ratio
``two replicas / one`` (about the cores' share each replica gets: near 1 on a machine whose
cores one replica already fills). ``--small`` (the tests): the replicas in threads of this
process, one round of a second with 4 clients, httpx unless ``wrk`` is installed.
"""

from __future__ import annotations

import argparse
import os
import statistics

from benchmarks import small
from benchmarks.cluster import Cluster
from benchmarks.httpx_load import run_httpx
from benchmarks.server_load import add_server_load_flags, ensure_load_generator
from benchmarks.service_throughput import multipart_png, sample_pngs
from benchmarks.wrk_load import run_wrk
from detector.guard import Guard

SETUPS = ("one replica", "two replicas")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both setups")
    p.add_argument(
        "--seconds", type=float, default=10.0, help="measured seconds per setup and round"
    )
    p.add_argument("--torch-threads", type=int, default=None, help="each replica's forward threads")
    add_server_load_flags(p, device="cpu", warmup=3.0, servers="the servers")
    p.add_argument(
        "--small",
        action="store_true",
        help="seconds: one round of 1 s with 4 clients, the replicas in threads of this process, "
        "httpx unless wrk is installed",
    )
    return small.parse(p, argv, rounds=1, seconds=1.0, warmup=0.3, clients=4,
                       load_generator=small.httpx_unless_wrk, one_torch_thread=True)  # fmt: skip


def replica_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--max-batch-size", str(args.max_batch_size)]
    return flags + (["--torch-threads", str(args.torch_threads)] if args.torch_threads else [])


def measure(args: argparse.Namespace, url: str, body: bytes, content_type: str) -> dict[str, float]:
    """One measure of ``url``'s /v1/predict with the chosen load generator, after a warm-up."""
    predict = url + "/v1/predict"
    if args.load_generator == "wrk":
        run_wrk(predict, body, content_type, clients=args.clients, seconds=args.warmup)
        return run_wrk(predict, body, content_type, clients=args.clients, seconds=args.seconds)
    return run_httpx(predict, body, content_type, clients=args.clients, seconds=args.seconds,
                     warmup=args.warmup)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ensure_load_generator(args, servers="the servers")
    body, content_type = multipart_png(
        sample_pngs(Guard.from_bundle(args.bundle, device="cpu"), 1)[0]
    )
    env = {"LAPGUARD_MAX_QUEUE": str(max(512, 4 * args.clients))}
    print(f"bundle {args.bundle}, {os.cpu_count()} CPUs, {args.clients} clients, "
          f"{args.load_generator}, nginx in front of both setups")  # fmt: skip
    rates: dict[str, list[dict[str, float]]] = {name: [] for name in SETUPS}
    with Cluster(args.bundle, replicas=2, flags=replica_flags(args), env=env,
                 groups=[[0], [0, 1]], in_process=args.small) as cluster:  # fmt: skip
        for round_ in range(1, args.rounds + 1):
            for name, url in zip(SETUPS, cluster.urls, strict=True):
                figures = measure(args, url, body, content_type)
                rates[name].append(figures)
                print(f"round {round_} {name}: {figures['rate']:.1f} requests/s, p50 "
                      f"{figures['p50']:.2f} ms, p99 {figures['p99']:.2f} ms, "
                      f"{figures['errors'] + figures['socket_errors']:.0f} errors")  # fmt: skip
    medians = {name: statistics.median(f["rate"] for f in runs) for name, runs in rates.items()}
    for name, runs in rates.items():
        p50 = statistics.median(f["p50"] for f in runs)
        print(f"{name}: median {medians[name]:.1f} requests/s, p50 {p50:.2f} ms")
    ratio = medians["two replicas"] / medians["one replica"]
    print(f"two replicas / one: {ratio:.2f} (median of {args.rounds} interleaved rounds)")


if __name__ == "__main__":
    main()
