"""Stateful detection against real query attacks through the HTTP API.

Starts `lapguard serve` on a bundle (query memory in process, action 'flag'), then:
1. attacks: ART HopSkipJump, Boundary and Square, each run on one correctly classified
   Fashion-MNIST test image, with the served network as the oracle through ``/v2`` FP32 (what a
   careful attacker sends: no 8-bit rounding). Every run is a separate client (its own loopback
   source address, 127.x.y.z). A run stops at the first query the server answers with
   ``query_attack: true`` (or when the attack ends); prints the share of runs detected and the
   median number of queries (images sent) until detection;
2. benign traffic: ``--clients`` clients, each sending ``--images`` distinct clean test images (no
   image shared between clients) through ``/v1/predict`` as PNG, plus resends of its own images
   (byte-identical), JPEG q90 re-encodes and 1-pixel crops, in requests of 1-4 images, clients
   interleaved; prints falsely flagged clients and the share of flagged benign queries.

    LAPGUARD_DATA=data python -m benchmarks.query_attacks --bundle runs/smoke/bundle \
        [--runs 10] [--clients 100] [--images 100]
    python -m benchmarks.query_attacks --bundle BUNDLE --small   # one Square run, 2 clients (tests)

``--network DIR`` (a network saved by `lapguard train`) serves that network instead, in a bundle
written beside it with the zero-shot quantile detector fitted on 2,000 clean training images (the
query memory does not read the detector; this only makes a servable bundle without attacks).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from benchmarks import small
from benchmarks.local_server import start_server, stop_server
from training.data.datasets import load_dataset, to_arrays

CHUNK = 64  # images per request: the server's max_images_per_request default


class Detected(Exception):
    """Raised inside the attack at the first query the server flags, to end the run there."""


def client_address(index: int) -> str:
    """A distinct loopback source address per client (all of 127/8 reaches lo)."""
    return f"127.{10 + index // 62500}.{(index // 250) % 250}.{index % 250 + 1}"


@dataclass
class Oracle:
    """The served network as ART's black box, for one client; counts queries until flagged."""

    url: str
    model: str
    client: httpx.Client
    queries: int = 0
    detected_at: int | None = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        parts = [self._infer(x[i : i + CHUNK]) for i in range(0, len(x), CHUNK)]
        return np.concatenate(parts)

    def _infer(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32"}]}
        body["inputs"][0]["data"] = x.ravel().tolist()
        response = self.client.post(f"{self.url}/v2/models/{self.model}/infer", json=body)
        response.raise_for_status()
        outputs = {o["name"]: o for o in response.json()["outputs"]}
        flags = np.asarray(outputs["query_attack"]["data"], dtype=bool)
        if flags.any() and self.detected_at is None:
            self.detected_at = self.queries + int(np.argmax(flags)) + 1
        self.queries += len(x)
        if self.detected_at is not None:
            raise Detected
        probabilities = np.asarray(outputs["probabilities"]["data"], dtype=np.float32)
        return probabilities.reshape(len(x), -1)


def _attack(name: str, classifier, eps: float):
    from art.attacks.evasion import BoundaryAttack, HopSkipJump, SquareAttack

    if name == "hsj":  # the seed's budget: 50 iterations, 10,000 evaluations
        return HopSkipJump(classifier, targeted=False, norm=2, max_iter=50, max_eval=10000,
                           init_eval=100, init_size=100, batch_size=CHUNK, verbose=False)  # fmt: skip
    if name == "boundary":
        return BoundaryAttack(classifier, targeted=False, max_iter=500, delta=0.01, epsilon=0.01,
                              batch_size=CHUNK, verbose=False)  # fmt: skip
    return SquareAttack(classifier, norm=np.inf, eps=eps, max_iter=1000, p_init=0.8,
                        nb_restarts=1, batch_size=CHUNK, verbose=False)  # fmt: skip


def run_attacks(url: str, model: str, images: np.ndarray, labels: np.ndarray, args) -> None:
    from art.estimators.classification.blackbox import BlackBoxClassifierNeuralNetwork

    client_index = 0
    for name in args.attacks:
        found: list[int | None] = []
        ended: list[int] = []
        started = time.perf_counter()
        for run, (image, label) in enumerate(
            zip(images[: args.runs], labels[: args.runs], strict=True)
        ):
            # ART draws from numpy's global generator: seeded per run, a run sends the same
            # queries under any detector settings, up to where it is stopped
            np.random.seed(args.seed + run)
            transport = httpx.HTTPTransport(local_address=client_address(client_index))
            client_index += 1
            with httpx.Client(transport=transport, timeout=60) as client:
                oracle = Oracle(url, model, client)
                classifier = BlackBoxClassifierNeuralNetwork(
                    oracle, (1, 28, 28), 10, clip_values=(0.0, 1.0)
                )
                with contextlib.suppress(Detected):  # the run ends at the first flagged query
                    _attack(name, classifier, args.eps).generate(image[None], y=np.eye(10)[[label]])
                found.append(oracle.detected_at)
                if oracle.detected_at is None:  # the attack ended first (Square: it succeeded)
                    ended.append(oracle.queries)
        detected = [q for q in found if q is not None]
        median = statistics.median(detected) if detected else float("nan")
        undetected = ", ".join(f"{q} x{ended.count(q)}" for q in sorted(set(ended))) or "none"
        at = ", ".join(f"{q} x{detected.count(q)}" for q in sorted(set(detected))) or "none"
        print(
            f"{name}: {len(detected)}/{len(found)} runs detected; queries until detection: "
            f"median {median}, max {max(detected, default=0)} ({at}); undetected runs ended after "
            f"(queries x runs): {undetected} ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )


def _png(image: np.ndarray, *, crop: int = 0, fmt: str = "PNG") -> bytes:
    pil = Image.fromarray((image[0] * 255).round().astype(np.uint8))
    if crop:
        pil = pil.crop((crop, crop, 28 - crop, 28 - crop)).resize((28, 28), Image.BILINEAR)
    buffer = io.BytesIO()
    pil.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def benign_stream(images: np.ndarray, rng: np.random.Generator) -> list[bytes]:
    """One benign client's uploads: its distinct images, with ~10% resends, ~5% JPEG re-encodes
    and ~5% 1-pixel crops of images it sent earlier, inserted at random later positions."""
    blobs = [_png(x) for x in images]
    n = len(images)
    copies: list[tuple[int, bytes]] = []
    for kind, count in (("resend", n // 10), ("jpeg", n // 20), ("crop", n // 20)):
        for source in rng.integers(0, n, count):
            blob = {"resend": blobs[source], "jpeg": _png(images[source], fmt="JPEG"),
                    "crop": _png(images[source], crop=1)}[kind]  # fmt: skip
            copies.append((int(rng.integers(source + 1, n + 1)), blob))
    stream = list(blobs)
    for position, blob in sorted(copies, key=lambda c: -c[0]):
        stream.insert(position, blob)
    return stream


def run_benign(url: str, images: np.ndarray, args) -> None:
    rng = np.random.default_rng(0)
    streams = [
        benign_stream(images[i * args.images : (i + 1) * args.images], rng)
        for i in range(args.clients)
    ]

    def send(index: int) -> tuple[int, int]:
        transport = httpx.HTTPTransport(local_address=client_address(100_000 + index))
        stream, flagged, local = streams[index], 0, np.random.default_rng(index)
        with httpx.Client(transport=transport, timeout=60) as client:
            position = 0
            while position < len(stream):
                size = int(local.integers(1, 5))
                part = stream[position : position + size]
                files = [("files", (f"{i}.png", b, "image/png")) for i, b in enumerate(part)]
                response = client.post(url + "/v1/predict", files=files)
                response.raise_for_status()
                flagged += sum(r["query_attack"] for r in response.json()["results"])
                position += size
        return flagged, len(stream)

    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, range(args.clients)))
    flagged = sum(f for f, _ in results)
    total = sum(n for _, n in results)
    clients = sum(f > 0 for f, _ in results)
    print(
        f"benign: {clients}/{args.clients} clients falsely flagged; {flagged}/{total} queries "
        f"flagged ({100 * flagged / total:.3f}%) ({time.perf_counter() - started:.0f} s)",
        flush=True,
    )


def bundle_for(network_dir: Path) -> Path:
    """``network_dir``/stateful-bundle, written once: the network + a zero-shot quantile detector."""
    from detector.bundle import write_bundle
    from detector.calibration import Calibration, calibrate_threshold, empirical_fpr
    from detector.features import extract_features
    from detector.networks import load
    from detector.quantile import QuantileDetector

    out = network_dir / "stateful-bundle"
    if (out / "manifest.json").is_file():
        return out
    network = load(network_dir)
    clean, _ = to_arrays(load_dataset("fashion-mnist", "train"), 2000, seed=0)
    features, logits = extract_features(network, clean)
    fit, held = slice(0, 1000), slice(1000, None)
    detector = QuantileDetector().fit(features[fit])
    scores = detector.score(features[held], logits[held].argmax(1))
    threshold = calibrate_threshold(scores, 0.05)
    calibration = Calibration(
        threshold=threshold, target_fpr=0.05, achieved_fpr=empirical_fpr(scores, threshold), n=1000
    )
    return write_bundle(out, network_dir=network_dir, detector=detector, calibration=calibration,
                        name=network_dir.name, dataset="fashion-mnist")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--bundle", type=Path)
    source.add_argument("--network", type=Path, help="a trained network directory")
    parser.add_argument("--runs", type=int, default=10, help="attack runs per attack")
    parser.add_argument("--attacks", nargs="+", default=["hsj", "boundary", "square"])
    parser.add_argument("--eps", type=float, default=0.1, help="Square's L-inf budget")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="run i seeds numpy's global generator (ART) with seed + i",
    )
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--images", type=int, default=100, help="distinct images per client")
    parser.add_argument("--skip-benign", action="store_true")
    parser.add_argument("--neighbours", type=int, default=None, help="LAPGUARD_QUERY_NEIGHBOURS")
    parser.add_argument("--levels", type=int, default=None, help="LAPGUARD_QUERY_LEVELS")
    parser.add_argument(
        "--candidates", type=int, default=2048, help="test images the attacked ones come from"
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="seconds: one Square run, 2 benign clients of 8 images, the server in a thread of "
        "this process",
    )
    return small.parse(parser, argv, runs=1, attacks=["square"], clients=2, images=8, candidates=64)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    images, labels = to_arrays(load_dataset("fashion-mnist", "test"))
    env = {"LAPGUARD_QUERY_MEMORY": "memory", "LAPGUARD_MAX_QUEUE": "4096"}
    if args.neighbours is not None:
        env["LAPGUARD_QUERY_NEIGHBOURS"] = str(args.neighbours)
    if args.levels is not None:
        env["LAPGUARD_QUERY_LEVELS"] = str(args.levels)
    bundle = args.bundle if args.bundle is not None else bundle_for(args.network)
    process, url = start_server(bundle, flags=[], env=env, in_process=args.small)
    try:
        model = httpx.get(url + "/v1/model", timeout=10).json()["name"]
        probe = Oracle(
            url, model, httpx.Client(transport=httpx.HTTPTransport(local_address="127.9.9.9"))
        )
        n = args.candidates
        predicted = np.concatenate([probe(images[i : min(i + 512, n)]) for i in range(0, n, 512)])
        correct = np.flatnonzero(predicted.argmax(1) == labels[:n])[: args.runs]
        print(f"server {url}, model {model}; attack images: {len(correct)} correctly classified")
        run_attacks(url, model, images[correct], labels[correct], args)
        if not args.skip_benign:
            run_benign(url, images, args)
    finally:
        stop_server(process)


if __name__ == "__main__":
    main()
