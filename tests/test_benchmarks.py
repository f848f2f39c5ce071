"""Every maintained benchmark's ``--small`` mode, run in this process on tiny inputs (the smoke
run's networks and bundle, a few images, a second of load), so that a change in detector/,
training/ or service/ that breaks a benchmark fails the suite. The assertions read what each one
prints: its ratio lines are there and their numbers are finite and positive. The tests that read
the smoke run are marked slow, as every reader of it is."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import (
    attack_costs,
    attack_probe,
    batch_scoring,
    cluster_throughput,
    feature_overhead,
    guard_cost,
    lap_overhead,
    minimal_attacks,
    ood_probe,
    query_attacks,
    query_memory,
    service_peers,
    service_throughput,
    soak,
)

BENCHMARKS = Path(attack_costs.__file__).parent


@pytest.fixture(autouse=True)
def process_state() -> Iterator[None]:
    """The small modes run torch on one thread and ART seeds numpy's global generator; the rest of
    the suite keeps its own."""
    threads, generator = torch.get_num_threads(), np.random.get_state()
    yield
    torch.set_num_threads(threads)
    np.random.set_state(generator)


def figures(pattern: str, text: str) -> list[float]:
    """The numbers ``pattern``'s groups capture in ``text`` (it must match)."""
    found = re.search(pattern, text, re.MULTILINE)
    assert found is not None, f"no {pattern!r} in:\n{text}"
    return [float(value) for value in found.groups()]


def positive(*values: float) -> bool:
    return all(math.isfinite(value) and value > 0 for value in values)


def test_lap_overhead(data_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lap_overhead.main(["--small"])
    out = capsys.readouterr().out
    assert figures(r"images/epoch: (\d+)", out) == [128]
    assert positive(*figures(r"LAP / vanilla epoch time: ([\d.]+)", out))


@pytest.mark.slow
def test_attack_costs(smoke_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    attack_costs.main(["--run", str(smoke_run), "--small", "--cache", str(tmp_path)])
    out = capsys.readouterr().out
    table = out[out.index("| network |") :]
    rows = re.findall(r"^\| (vanilla|lap) \| fgm \| ([\d.]+) \| 8 \| ([\d.]+) \|.*\| ([\d.]+) \|$",
                      table, re.MULTILINE)  # fmt: skip
    assert {(network, eps) for network, eps, *_ in rows} == {
        (network, eps) for network in ("vanilla", "lap") for eps in ("0.03", "0.1")
    }
    for _, _, accuracy, seconds in rows:
        assert 0 <= float(accuracy) <= 1 and positive(float(seconds))


@pytest.mark.slow
def test_feature_overhead(smoke_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    feature_overhead.main(["--small", "--network", str(smoke_run / "models" / "lap"),
                           "--bundle", str(smoke_run / "bundle")])  # fmt: skip
    out = capsys.readouterr().out
    assert "trained (" in out  # the smoke network, not default-initialized weights
    assert positive(*figures(r"\[1\] batch 64: .*; ratio wall ([\d.]+), CPU ([\d.]+)", out))
    assert positive(*figures(r"\[2\] 128 images .* = wall ([\d.]+), CPU ([\d.]+) x", out))
    assert positive(*figures(r"\[4\] .*: share wall ([\d.]+)%, CPU ([\d.]+)%", out))
    assert positive(*figures(r"\[5\] bundle .*: share wall ([\d.]+)%.*Guard / plain forward "
                             r"wall ([\d.]+), CPU ([\d.]+)", out))  # fmt: skip


def test_guard_cost(capsys: pytest.CaptureFixture[str]) -> None:
    guard_cost.main(["--small"])
    out = capsys.readouterr().out
    for name in ("resnet50", "vit"):
        pattern = rf"^{name}: .* Guard / plain forward ([\d.]+) .*bundle recorded ([\d.]+), ([\d.]+)% apart"
        ratio, recorded, apart = figures(pattern, out)
        assert positive(ratio, recorded) and math.isfinite(apart)


@pytest.mark.slow
def test_minimal_attacks(smoke_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    minimal_attacks.main([str(smoke_run / "models" / "lap"), "--small"])
    out = capsys.readouterr().out
    ratios = re.findall(r"^\| (\S+)-batched.* \| ([+-][\d.]+) \| ([\d.na]+) \| ([\d.]+)x \|", out,
                        re.MULTILINE)  # fmt: skip
    assert [pair for pair, *_ in ratios] == ["cw", "deepfool", "apgd"]
    for _, points, l2_ratio, speedup in ratios:
        assert abs(float(points)) <= 100 and positive(float(l2_ratio), float(speedup))
    assert "n=2;" in out


@pytest.mark.slow
def test_ood_probe(smoke_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ood_probe.main([str(smoke_run / "bundle"), "--small"])
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| ([\w-]+) \| 8 \| ([\d.]+) \|", out, re.MULTILINE))
    assert {"clean", "rot90", "letters", "photos", "constant"} <= set(rows)
    assert all(0 <= float(flagged) <= 100 for flagged in rows.values())
    assert positive(*figures(r"held-out clean \(manifest\) \| \| ([\d.]+) \|", out))


@pytest.mark.slow
def test_attack_probe(smoke_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    attack_probe.main([str(smoke_run), "--small", "--cache", str(tmp_path)])
    out = capsys.readouterr().out
    for name in ("pgd-linf-0.05", "newtonfool"):
        assert positive(*figures(rf"{name}: success [\d.]+%, ([\d.]+) s/image", out))
    assert re.search(
        r"^\| clean \(held-out, classified right\) .*\| +[\d.]+ \|$", out, re.MULTILINE
    )
    assert re.search(r"^\| PGD L∞ ε=0\.05.*\| +[\d.]+ \|$", out, re.MULTILINE)
    assert list(tmp_path.glob("*.npz")), "the attacked images are cached where --cache says"


@pytest.mark.slow
def test_batch_scoring(smoke_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batch_scoring.main(["--bundle", str(smoke_run / "bundle"), "--small"])
    out = capsys.readouterr().out
    assert out.count("scored 256, errors 0") == 2  # in process and through --url
    assert positive(*figures(r"lapguard score / in-process Guard: ([\d.]+)", out))
    assert positive(*figures(r"lapguard score --url / in-process Guard: ([\d.]+)", out))
    assert "rows: 0 differ in label or flag" in out


@pytest.mark.slow
def test_query_memory(smoke_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    query_memory.main(["--bundle", str(smoke_run / "bundle"), "--small"])
    out = capsys.readouterr().out
    for levels in (3, 4, 5):
        assert f"levels {levels} (covers L-inf eps" in out
    assert figures(r"PNG resend (\d+)% \(exact (\d+)%\)", out) == [100, 100]
    assert positive(*figures(r"in-process observe, 300 stored \(clean .*median ([\d.]+) ms", out))
    served = r"off ([\d.]+) ms, on ([\d.]+) ms, added ([+-][\d.]+) ms"
    off, on, added = figures(served, out)
    assert positive(off, on) and math.isfinite(added)
    assert positive(*figures(r"of those 20 requests: mean ([\d.]+) ms", out))


@pytest.mark.slow
def test_query_attacks(smoke_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    query_attacks.main(["--bundle", str(smoke_run / "bundle"), "--small"])
    out = capsys.readouterr().out
    detected, runs = figures(r"square: (\d+)/(\d+) runs detected", out)
    assert runs == 1 and detected <= runs
    clients, queries = figures(r"benign: (\d+)/2 clients falsely flagged; \d+/(\d+) queries", out)
    assert clients <= 2 and queries >= 16


@pytest.mark.slow
def test_service_throughput(smoke_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    service_throughput.main(["--bundle", str(smoke_run / "bundle"), "--small"])
    out = capsys.readouterr().out
    assert positive(*figures(r"in-process best: ([\d.]+) images/s", out))
    assert positive(*figures(r"detector share at batch 256: ([\d.]+)%", out))
    assert figures(r"with 4 clients \((\d+) errors\)", out) == [0]
    assert positive(*figures(r"ratio to in-process best ([\d.]+)", out))
    assert positive(*figures(r"p50 / in-process single ([\d.]+)", out))


@pytest.mark.slow
def test_cluster_throughput(service_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two replicas in threads behind nginx against one: no failed request, a ratio line."""
    cluster_throughput.main(["--bundle", str(service_bundle), "--small"])
    out = capsys.readouterr().out
    assert re.findall(r"^round 1 (one|two) replicas?: ", out, re.MULTILINE) == ["one", "two"]
    assert set(re.findall(r"ms, (\d+) errors$", out, re.MULTILINE)) == {"0"}
    assert positive(*figures(r"^two replicas / one: ([\d.]+)", out))


@pytest.mark.slow
def test_service_peers(smoke_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """lapguard against the floor only: MLServer and Ray Serve take minutes to install."""
    service_peers.main(["--bundle", str(smoke_run / "bundle"), "--small"])
    out = capsys.readouterr().out
    assert "MLServer and Ray Serve are not run" in out
    for scenario in ("1 client", "32 clients", "4 x 64 images"):
        ratio = figures(rf"^- {scenario}: lapguard / floor \(floor x1\) ([\d.]+)$", out)
        assert positive(*ratio)
    assert "errors)" not in out  # no failed request on either server


@pytest.mark.slow
def test_soak(smoke_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    soak.main(["--bundle", str(smoke_run / "bundle"), "--small", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    requests, rate = figures(r"^(\d+) requests before the stop \(([\d.]+)/s\)", out)
    assert positive(requests, rate)
    unexpected = re.findall(r"^(?:png|json_b64|v2_bytes|bad_json) +\d+ +\d+ +(\d+) ", out,
                            re.MULTILINE)  # fmt: skip
    assert unexpected == ["0"] * 4  # every valid request answered 200, bad JSON 422
    assert "PASS  no 5xx" in out and "PASS  0 lost on a graceful stop" in out
    assert (tmp_path / "soak.json").is_file() and (tmp_path / "soak.png").is_file()


MAINTAINED = (
    "attack_costs", "attack_probe", "batch_scoring", "cluster_throughput", "feature_overhead",
    "guard_cost", "lap_overhead",
    "minimal_attacks", "ood_probe", "query_attacks", "query_memory", "service_peers",
    "service_throughput", "soak",
)  # fmt: skip


@pytest.mark.parametrize("name", MAINTAINED)
def test_benchmark_runs_as_a_module_with_a_small_mode(name: str) -> None:
    """Its docstring gives the module command, it has a --small mode, and nothing in benchmarks/
    edits sys.path (they import each other as benchmarks.X)."""
    source = (BENCHMARKS / f"{name}.py").read_text()
    assert f"python -m benchmarks.{name} " in source.split('"""')[1]
    assert '"--small"' in source and "def main(argv: list[str] | None = None)" in source
    assert not [p for p in BENCHMARKS.rglob("*.py") if "sys.path" in p.read_text()]
