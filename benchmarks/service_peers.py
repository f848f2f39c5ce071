"""lapguard against the servers a user would otherwise pick, on the same cores, model and load.

    python -m benchmarks.service_peers --bundle runs/quick/bundle [--seconds 15] [--rounds 2]
    python -m benchmarks.service_peers --bundle BUNDLE --small   # lapguard and the floor (tests)

The same bundle's Guard is served, one server at a time, by
  * lapguard   — ``lapguard serve`` (its ``/v2`` inference route, defaults as shipped);
  * mlserver   — MLServer, a custom runtime (:mod:`benchmarks.peers.mlserver_runtime`), adaptive
    batching on;
  * ray-serve  — Ray Serve, a deployment whose ``@serve.batch`` method runs the Guard;
  * floor      — a bare ASGI app under the same uvicorn (:mod:`benchmarks.peers.floor_app`): read
    the body, decode the PNGs, batch what arrives while the Guard computes, answer; nothing else.
Every server receives the same Open Inference Protocol body (a BYTES input of base64 PNGs) and
answers label, flagged and score; the benchmark first checks that each one's answer equals the
in-process Guard's. Load comes from ``wrk`` (C, one thread): 1 and 32 concurrent single-image
clients and 4 clients of 64-image requests, ``--seconds`` each after a warm-up. lapguard runs with
its own defaults (it picks the forward pass's threads per batch); every other server runs once at
each of ``--peer-threads`` (default: the cores less one, and all cores), so each is compared at
its best. Servers are run in turn, ``--rounds`` times, the order reversed every round (drift on
this machine is minutes long); the table gives each figure's median over rounds and the ratios
lapguard / best peer and lapguard / best floor, per scenario. MLServer and Ray are installed by
the benchmark into ``--peers-venv`` (which sees the product's packages for torch), so the
product's dependencies stay lean. Run it alone.

``--small`` (the tests) compares lapguard (in a thread of this process) with the floor only, half
a second per scenario, one round: MLServer and Ray Serve need the peers' environment, minutes to
install on a fresh machine. Its load comes from httpx when ``wrk`` is not installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks import small
from benchmarks.httpx_load import run_httpx
from benchmarks.peer_servers import SERVERS, PeerServer, ensure_peers_venv
from benchmarks.peers.v2_images import v2_body
from benchmarks.server_load import add_load_generator_flag
from benchmarks.service_throughput import sample_pngs
from benchmarks.wrk_load import ensure_wrk, run_wrk
from detector.guard import Guard
from detector.images import decode_image
from service.settings import default_torch_threads, usable_cores

#: (name, concurrent clients, images per request)
SCENARIOS = (("1 client", 1, 1), ("32 clients", 32, 1), ("4 x 64 images", 4, 64))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=15.0, help="measured load per scenario")
    p.add_argument("--warmup", type=float, default=4.0, help="unmeasured load before each one")
    p.add_argument("--rounds", type=int, default=2, help="passes over the servers")
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset")
    p.add_argument(
        "--torch-threads",
        type=int,
        help="lapguard's forward-pass threads (LAPGUARD_TORCH_THREADS; default: its own choice)",
    )
    p.add_argument(
        "--peer-threads",
        default=",".join(str(t) for t in sorted({default_torch_threads(), usable_cores()})),
        help="the peers' and the floor's thread counts, each run at every one (default: the cores "
        "less one, and all cores: the best of a peer is what a user tuning it would get)",
    )
    p.add_argument("--peers-venv", type=Path, default=Path(".venv-peers"))
    p.add_argument("--out", type=Path, help="write results.json and table.md here")
    add_load_generator_flag(p, servers="the servers")
    p.add_argument(
        "--small",
        action="store_true",
        help="seconds: lapguard and the floor on 1 thread, 0.5 s per scenario, 1 round, httpx "
        "unless wrk is installed",
    )
    return small.parse(p, argv, servers="lapguard,floor", peer_threads="1", torch_threads=1,
                       seconds=0.5, warmup=0.0, rounds=1,
                       load_generator=small.httpx_unless_wrk)  # fmt: skip


def check_answers(server: PeerServer, guard: Guard, pngs: list[bytes]) -> None:
    """The server's labels and scores for ``pngs`` equal the in-process Guard's."""
    answer = httpx.post(server.infer_url, content=v2_body(pngs), timeout=60,
                        headers={"content-type": "application/json"})  # fmt: skip
    answer.raise_for_status()
    outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
    expected = guard.predict_images([decode_image(png) for png in pngs])
    if outputs["label"] != expected.labels.tolist():
        raise SystemExit(f"{server.name} answers other labels than the Guard")
    if not np.allclose(outputs["score"], expected.scores, rtol=1e-4, atol=1e-5):
        raise SystemExit(f"{server.name} answers other scores than the Guard")


def measure_server(
    server: PeerServer, bodies: dict[int, bytes], args: argparse.Namespace, label: str
) -> dict[str, dict[str, float]]:
    """Each scenario's load figures (wrk's, or httpx's) on a running server (images/s added)."""
    figures = {}
    load = run_wrk if args.load_generator == "wrk" else run_httpx
    for name, clients, images in SCENARIOS:
        body = bodies[images]
        if args.warmup > 0:
            load(server.infer_url, body, "application/json", clients=clients, seconds=args.warmup)
        result = load(
            server.infer_url, body, "application/json", clients=clients, seconds=args.seconds
        )
        result["images_per_s"] = result["rate"] * images
        figures[name] = result
        bad = result["errors"] + result["socket_errors"]
        print(f"  {label:14s} {name:14s} {result['images_per_s']:8.1f} images/s  "
              f"p50 {result['p50']:7.2f} ms  p99 {result['p99']:7.2f} ms"
              + (f"  ({bad:.0f} errors)" if bad else ""), flush=True)  # fmt: skip
    return figures


def median_figures(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per scenario and figure, the median over rounds."""
    return {
        name: {key: statistics.median(run[name][key] for run in runs) for key in runs[0][name]}
        for name, _, _ in SCENARIOS
    }


def table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """The markdown table: images/s and p50/p99 per server and scenario, then the ratios."""
    lines = [
        "| server | " + " | ".join(f"{n}: images/s, p50 / p99 ms" for n, _, _ in SCENARIOS) + " |"
    ]
    lines.append("|---" * (len(SCENARIOS) + 1) + "|")
    for server, figures in results.items():
        cells = [f"{f['images_per_s']:,.0f}, {f['p50']:.2f} / {f['p99']:.2f}"
                 for f in (figures[n] for n, _, _ in SCENARIOS)]  # fmt: skip
        lines.append(f"| {server} | " + " | ".join(cells) + " |")
    lines += ["", *ratio_lines(results)]
    return "\n".join(lines)


def ratio_lines(results: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """lapguard / best peer and lapguard / best floor (throughput, each at its best thread count
    per scenario), and the 1-client p50s."""
    if "lapguard" not in results:
        return []
    ours = results["lapguard"]
    peers = {k: v for k, v in results.items() if k != "lapguard" and not k.startswith("floor")}
    floors = {k: v for k, v in results.items() if k.startswith("floor")}
    lines = []
    for name, _, _ in SCENARIOS:
        parts = []
        for kind, group in (("best peer", peers), ("floor", floors)):
            if group:
                best = max(group, key=lambda p: group[p][name]["images_per_s"])
                ratio = ours[name]["images_per_s"] / group[best][name]["images_per_s"]
                parts.append(f"lapguard / {kind} ({best}) {ratio:.2f}")
        lines.append(f"- {name}: " + ", ".join(parts))
    if peers:
        best = min(peers, key=lambda p: peers[p]["1 client"]["p50"])
        lines.append(f"- p50 at 1 client: lapguard {ours['1 client']['p50']:.2f} ms, best peer "
                     f"({best}) {peers[best]['1 client']['p50']:.2f} ms")  # fmt: skip
    return lines


def entries(names: list[str], args: argparse.Namespace) -> list[tuple[str, str, int | None]]:
    """(label, server, torch threads) of each server to run: lapguard once, with its own choice
    unless ``--torch-threads``; every other server at each of ``--peer-threads``."""
    counts = sorted({int(t) for t in args.peer_threads.split(",") if t.strip()})
    chosen: list[tuple[str, str, int | None]] = []
    for name in names:
        if name == "lapguard":
            chosen.append((name, name, args.torch_threads))
        else:
            chosen += [(f"{name} x{t}", name, t) for t in counts]
    return chosen


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = set(names) - set(SERVERS)
    if unknown:
        raise SystemExit(f"unknown servers {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    if args.small:
        print("small mode: lapguard and the floor only (MLServer and Ray Serve are not run: "
              "their environment takes minutes to install)")  # fmt: skip
    if args.load_generator == "wrk":
        ensure_wrk()
    else:
        print("load from httpx in this process (wrk is not used)")
    peers_python = (
        ensure_peers_venv(args.peers_venv) if {"mlserver", "ray-serve"} & set(names) else None
    )
    guard = Guard.from_bundle(args.bundle, device="cpu")
    pngs = sample_pngs(guard, 64)
    bodies = {1: v2_body(pngs[:1]), 64: v2_body(pngs)}
    chosen = entries(names, args)
    runs: dict[str, list[dict[str, dict[str, float]]]] = {label: [] for label, _, _ in chosen}
    started = time.monotonic()
    for round_ in range(args.rounds):
        order = chosen if round_ % 2 == 0 else chosen[::-1]
        print(f"round {round_ + 1}/{args.rounds}: {', '.join(e[0] for e in order)}", flush=True)
        for label, name, threads in order:
            server_type = SERVERS[name]
            with server_type(args.bundle, peers_python, threads, in_process=args.small) as server:
                check_answers(server, guard, pngs[:8])
                runs[label].append(measure_server(server, bodies, args, label))
    results = {name: median_figures(figures) for name, figures in runs.items()}
    text = table(results)
    print(f"\nmedians over {args.rounds} rounds ({time.monotonic() - started:.0f} s in all):\n")
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(
            json.dumps({"runs": runs, "medians": results}, indent=1)
        )
        (args.out / "table.md").write_text(text + "\n")
        print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"{error.cmd[0]} failed: {error.stderr or error}") from None
