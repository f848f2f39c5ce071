"""The seed documents' headline claims, each measured on a ``diagnose`` run and judged by a rule
stated beside it. Networks are read by role (see
:class:`training.presets.pipelines.DiagnoseConfig`): ``resnet``, ``lap``, ``plain``, ``unit``.

Input: the diagnostics (training/diagnostics/diagnose.py) and each network's per-epoch metrics (test
accuracy, and the monitors' ``monitor_w_layers`` and ``monitor_ics``). Output: rows
``{"claim", "seed", "measured", "holds", "rule"}``; a claim whose networks are missing is left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy.stats import spearmanr

Metrics = Mapping[str, Sequence[Mapping[str, Any]]]
Claim = dict[str, Any]
LINE_SHAPED_LSS = 1.5  # a straight track has LSS 1; n unit steps in random directions ~ sqrt(n)


def _claim(claim: str, seed: str, measured: str, holds: bool, rule: str) -> Claim:
    return {"claim": claim, "seed": seed, "measured": measured, "holds": bool(holds), "rule": rule}


def _clean(diagnostics: Mapping[str, Any], role: str) -> Mapping[str, Any]:
    return diagnostics["networks"][role]["sets"]["clean"]


def _accuracy(metrics: Metrics, role: str) -> float:
    return float(metrics[role][-1]["test_accuracy"])


def w_decreases_with_depth(diagnostics: Mapping[str, Any], _: Metrics) -> Claim:
    """Seed 000, Theorem 2: W(layer, target) tends to decrease along the depth."""
    rhos = {}
    for role in diagnostics["networks"]:
        w = _clean(diagnostics, role)["w_layers"]
        rhos[role] = float(spearmanr(np.arange(len(w)), w).statistic)
    measured = ", ".join(f"{r}: rho {v:+.2f}" for r, v in rhos.items())
    return _claim(
        "W-distance to the target decreases with depth (clean test images)",
        "000",
        f"Spearman rho(layer, W) {measured}",
        all(v < 0 for v in rhos.values()),
        "rho < 0 on every network",
    )


def w_decreases_along_training(_: Mapping[str, Any], metrics: Metrics) -> Claim | None:
    """Seed 000, Theorem 3: one layer's W-distance decreases along training (monitors)."""
    changes = {}
    for role, rows in metrics.items():
        curves = [r["monitor_w_layers"] for r in rows if r.get("monitor_w_layers")]
        if len(curves) >= 2:
            changes[role] = np.asarray(curves[-1]) - np.asarray(curves[0])
    if not changes:
        return None
    share = float(np.mean(np.concatenate(list(changes.values())) < 0))
    measured = ", ".join(
        f"{r}: {int((c < 0).sum())}/{len(c)} layers lower" for r, c in changes.items()
    )
    return _claim(
        "Each layer's W-distance decreases along training (first vs last epoch)",
        "000",
        f"{measured} ({share:.0%} of all layers)",
        share >= 0.75,
        ">= 75% of (network, layer) pairs lower at the last epoch than after the first",
    )


def deeper_not_always_better(diagnostics: Mapping[str, Any], _: Metrics) -> Claim:
    """Seed 000, Theorem 4: for some samples an earlier layer is right and the last one wrong."""
    shares = {r: _clean(diagnostics, r)["confused_fraction"] for r in diagnostics["networks"]}
    return _claim(
        "A deeper layer is not always better for some samples",
        "000",
        ", ".join(f"{r}: {v:.1%} confused" for r, v in shares.items()),
        all(v > 0 for v in shares.values()),
        "some probe right and the head wrong on > 0% of samples, every network",
    )


def tracks_line_shaped(diagnostics: Mapping[str, Any], _: Metrics) -> Claim | None:
    """Seed 001 (geodesic curve): residual networks' data tracks are close to line-shaped."""
    roles = [r for r in ("resnet", "lap", "unit") if r in diagnostics["networks"]]
    if not roles:
        return None
    lss = {r: _clean(diagnostics, r)["lss"]["mean"] for r in roles}
    plain = diagnostics["networks"].get("plain")
    extra = f"; plain {plain['sets']['clean']['lss']['mean']:.2f}" if plain else ""
    return _claim(
        "Data tracks of residual networks are close to line-shaped",
        "001/002",
        "mean LSS " + ", ".join(f"{r} {v:.2f}" for r, v in lss.items()) + extra,
        all(v <= LINE_SHAPED_LSS for v in lss.values()),
        f"mean LSS <= {LINE_SHAPED_LSS} (straight line 1, random unit steps ~ sqrt(n))",
    )


def resnet_closer_to_ot(diagnostics: Mapping[str, Any], _: Metrics) -> Claim | None:
    """Seed 001: a ResNet's map is closer to the optimal transport map than a plain network's."""
    nets = diagnostics["networks"]
    if "resnet" not in nets or "plain" not in nets:
        return None

    def scores(role: str) -> tuple[float, float]:
        clean = _clean(diagnostics, role)
        blocks = [v for v in clean["ots_block"] if v is not None]
        return float(np.mean(clean["ots_network"])), float(np.mean(blocks))

    (res_net, res_blocks), (plain_net, plain_blocks) = scores("resnet"), scores("plain")
    return _claim(
        "A ResNet's map is closer to the OT map than a plain network's",
        "001/002",
        f"OTS x_0->x_M resnet {res_net:.3f} vs plain {plain_net:.3f}; per block "
        f"{res_blocks:.3f} vs {plain_blocks:.3f}",
        res_net > plain_net or (res_net == plain_net and res_blocks > plain_blocks),
        "the residual network's whole-map OTS higher (ties: per-block OTS higher)",
    )


def scores_track_performance(diagnostics: Mapping[str, Any], metrics: Metrics) -> Claim | None:
    """Seeds 001/002: higher OTS and lower LSS go with higher accuracy, across networks."""
    roles = [r for r in diagnostics["networks"] if r in metrics]
    if len(roles) < 3:
        return None
    accuracy = [_accuracy(metrics, r) for r in roles]
    lss = [_clean(diagnostics, r)["lss"]["mean"] for r in roles]
    ots = [float(np.mean(_clean(diagnostics, r)["ots_network"])) for r in roles]
    rho_lss = float(spearmanr(accuracy, lss).statistic)
    rho_ots = float(spearmanr(accuracy, ots).statistic) if len(set(ots)) > 1 else float("nan")
    return _claim(
        "LSS and OTS track performance across networks",
        "001/002",
        f"over {len(roles)} networks: rho(accuracy, LSS) {rho_lss:+.2f}, "
        f"rho(accuracy, OTS) {rho_ots:+.2f}",
        rho_lss < 0 and rho_ots > 0,
        "rho(accuracy, LSS) < 0 and rho(accuracy, OTS) > 0 (nan: OTS equal everywhere)",
    )


def _ics(metrics: Metrics, role: str) -> np.ndarray:
    return np.array([v for r in metrics[role] for v in (r.get("monitor_ics") or [])])


def unit_bounds_ics(_: Mapping[str, Any], metrics: Metrics) -> Claim | None:
    """Seed 004, Theorem 3.1: unitization bounds the ICS where BatchNorm does not."""
    if not {"resnet", "unit"} <= set(metrics) or not len(_ics(metrics, "unit")):
        return None
    bn, unit = _ics(metrics, "resnet"), _ics(metrics, "unit")
    return _claim(
        "Unitization bounds the ICS (EM distance between epochs) where BN does not",
        "004",
        f"ICS max / mean over blocks and epochs: BN {bn.max():.1f} / {bn.mean():.1f}, "
        f"unitization {unit.max():.1f} / {unit.mean():.1f}",
        unit.max() < bn.max(),
        "largest ICS of the unitized network below the BN network's",
    )


def unit_trains_as_well(_: Mapping[str, Any], metrics: Metrics) -> Claim | None:
    """Seed 004: unitization trains at least as well as BatchNorm."""
    if not {"resnet", "unit"} <= set(metrics):
        return None
    bn, unit = _accuracy(metrics, "resnet"), _accuracy(metrics, "unit")
    return _claim(
        "Unitization trains at least as well as BN",
        "004",
        f"test accuracy BN {bn:.2%}, unitization {unit:.2%}",
        unit >= bn,
        "unitized network's test accuracy >= the BN network's (same schedule)",
    )


def lap_straighter(diagnostics: Mapping[str, Any], metrics: Metrics) -> Claim | None:
    """Seed 003 (LAP): least-action training gives straighter tracks and no loss of accuracy."""
    if not {"resnet", "lap"} <= set(diagnostics["networks"]) or not {"resnet", "lap"} <= set(
        metrics
    ):
        return None
    van, lap = (
        _clean(diagnostics, "resnet")["lss"]["mean"],
        _clean(diagnostics, "lap")["lss"]["mean"],
    )
    acc_van, acc_lap = _accuracy(metrics, "resnet"), _accuracy(metrics, "lap")
    return _claim(
        "LAP training gives straighter tracks at no cost in accuracy",
        "003",
        f"mean LSS vanilla {van:.3f}, LAP {lap:.3f}; accuracy {acc_van:.2%} vs {acc_lap:.2%}",
        lap < van and acc_lap >= acc_van - 0.005,
        "LAP's mean LSS lower and its accuracy within 0.5 points of vanilla's or better",
    )


CLAIMS: list[Callable[[Mapping[str, Any], Metrics], Claim | None]] = [
    w_decreases_with_depth,
    w_decreases_along_training,
    deeper_not_always_better,
    tracks_line_shaped,
    resnet_closer_to_ot,
    scores_track_performance,
    unit_bounds_ics,
    unit_trains_as_well,
    lap_straighter,
]


def measure_claims(diagnostics: Mapping[str, Any], metrics: Metrics) -> list[Claim]:
    """Every claim that the run's networks allow to measure, in CLAIMS' order."""
    rows = [check(diagnostics, metrics) for check in CLAIMS]
    return [row for row in rows if row is not None]
