"""``lapguard diagnose``: the network-dynamics instruments of seeds 000, 001/002 and 004 on a
run's networks, clean test images and (optionally) its cached adversarial sets.

For every network and image set it measures, block by block (:mod:`detector.dynamics`):

* ``lss_block``/``lsr_block``: the line-shape score and ratio (seed 001, eq. 42-44) of each
  sample's track x_0 -> ... -> x_m up to block m (mean over samples): the per-block curve;
* ``ots_block``: the optimal transport score (seed 001, eq. 47) of block m's map x_{m-1} -> x_m
  on the set, and ``ots_network`` of each stage's whole map x_0 -> x_M;
* ``w_layers``: the mean W-distance between each layer's predicted label distribution and the
  one-hot target (seed 000, eq. 1-2, discrete ground cost), read by a linear probe head per
  layer (stem, every block) fitted on clean training images with the network frozen, then the
  network's own head; ``confused_fraction``: samples some probe gets right and the head wrong.

Results go to ``RUN/diagnostics.json``, keyed by the networks' and sets' checksums, so a second
call with the same inputs returns at once; figures go to ``RUN/figures/dynamics_*.png``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from detector import artefacts, dynamics, networks
from detector.errors import ArtefactError, ConfigError
from training.attacks import sets as adversarial
from training.data.network_images import attack_images
from training.diagnostics.claims import measure_claims
from training.evaluation.context import perturbed
from training.plots import plot_block_curves
from training.presets import get_train_preset
from training.presets.pipelines import NOT_COMPUTED, DiagnoseConfig
from training.rundir import ATTACKS_FIGURE, NETWORKS_FIGURE, RunDir
from training.trainer.loop import train
from training.trainer.probes import fit_probes

DIAGNOSE_VERSION = 1
CLEAN = "clean"


@dataclass(frozen=True)
class DiagnoseOptions:
    """How much data each measure uses: ``n`` test images per set, ``probe_n`` training images
    for the probe heads, ``ots_n`` samples per optimal assignment (its cost grows as n^2 d)."""

    n: int = 1000
    probe_n: int = 2000
    ots_n: int = 500
    attacks: bool = False
    batch_size: int = 250

    def key(self) -> dict[str, Any]:
        return {"n": self.n, "probe_n": self.probe_n, "ots_n": self.ots_n, "attacks": self.attacks}


# ---- one set through one network --------------------------------------------------------------
@dataclass
class SetPass:
    """What one forward pass over a set leaves: flattened states x_0..x_M (float32), each probe's
    label distribution, the head's, and the true labels."""

    states: list[np.ndarray]
    probe_probs: list[np.ndarray]
    head_probs: np.ndarray
    labels: np.ndarray


def run_set(
    model: nn.Module,
    probes: Sequence[nn.Module],
    x: np.ndarray,
    y: np.ndarray,
    *,
    device: torch.device,
    batch_size: int = 250,
) -> SetPass:
    """Block states and label distributions of ``x``, in batches, one forward pass each."""
    states: list[list[np.ndarray]] = []
    probs: list[list[np.ndarray]] = [[] for _ in probes]
    head: list[np.ndarray] = []
    with torch.no_grad():
        for tensors, logits in dynamics.batched_block_tensors(
            model, x, device=device, batch_size=batch_size
        ):
            for i, state in enumerate(tensors):
                if len(states) <= i:
                    states.append([])
                states[i].append(state.flatten(1).float().cpu().numpy())
                probs[i].append(torch.softmax(probes[i](state), 1).double().cpu().numpy())
            head.append(torch.softmax(logits, 1).double().cpu().numpy())
    return SetPass(
        [np.concatenate(s) for s in states],
        [np.concatenate(p) for p in probs],
        np.concatenate(head),
        np.asarray(y, dtype=np.int64),
    )


def cumulative_line_shape(states: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(LSS, LSR) of every sample's track x_0..x_m for m = 1..M (seed 001, eq. 42-44): two
    [N, M] arrays. A block that changes the state's shape starts a new stage (NaN there)."""
    n, blocks = len(states[0]), len(states) - 1
    lss, lsr = np.full((n, blocks), np.nan), np.full((n, blocks), np.nan)
    start, units, length, steps = states[0].astype(np.float64), None, np.zeros(n), 0
    for m in range(1, blocks + 1):
        current, previous = states[m].astype(np.float64), states[m - 1]
        if current.shape != previous.shape:
            start, units, length, steps = current, None, np.zeros(n), 0
            continue
        step = current - previous
        norm = np.linalg.norm(step, axis=1)
        unit = step / np.where(norm > 0, norm, 1.0)[:, None]
        units = unit if units is None else units + unit
        length, steps = length + norm, steps + 1
        lss[:, m - 1] = steps / np.maximum(np.linalg.norm(units, axis=1), 1e-12)
        chord = np.linalg.norm(current - start, axis=1)
        lsr[:, m - 1] = length / np.maximum(chord, 1e-12)
    return lss, lsr


def block_transport_scores(states: Sequence[np.ndarray], n: int) -> tuple[list, list]:
    """OTS (seed 001, eq. 47) of each block's map x_{m-1} -> x_m and of each stage's map
    x_first -> x_last, on the first ``n`` samples; None where a block changes the shape."""
    per_block: list[float | None] = []
    per_stage: list[float] = []
    first = 0
    for m in range(1, len(states)):
        before, after = states[m - 1][:n], states[m][:n]
        if before.shape != after.shape:
            per_block.append(None)
            if m - 1 > first:
                per_stage.append(dynamics.optimal_transport_score(states[first][:n], before))
            first = m
            continue
        per_block.append(dynamics.optimal_transport_score(before, after))
    if len(states) - 1 > first:
        per_stage.append(dynamics.optimal_transport_score(states[first][:n], states[-1][:n]))
    return per_block, per_stage


def _mean_columns(values: np.ndarray) -> list[float | None]:
    with np.errstate(invalid="ignore"):
        means = [float(np.nanmean(c)) if np.isfinite(c).any() else None for c in values.T]
    return means


def set_statistics(result: SetPass, *, ots_n: int) -> dict[str, Any]:
    """The per-block curves and summaries of one set (see the module docstring)."""
    lss, lsr = cumulative_line_shape(result.states)
    ots_block, ots_network = block_transport_scores(result.states, ots_n)
    cost = dynamics.label_cost(result.head_probs.shape[1])
    layers = [*result.probe_probs, result.head_probs]
    w_layers = [
        float(np.mean(dynamics.dirac_label_wasserstein(p, result.labels, cost))) for p in layers
    ]
    correct = np.stack([p.argmax(1) == result.labels for p in layers])
    final = lss[:, -1][np.isfinite(lss[:, -1])]
    return {
        "n": len(result.labels),
        "accuracy": float(correct[-1].mean()),
        "lss_block": _mean_columns(lss),
        "lsr_block": _mean_columns(lsr),
        "lss": {
            "mean": float(final.mean()) if len(final) else None,
            "median": float(np.median(final)) if len(final) else None,
            "q90": float(np.quantile(final, 0.9)) if len(final) else None,
        },
        "ots_block": ots_block,
        "ots_network": ots_network,
        "ots_n": min(ots_n, len(result.labels)),
        "w_layers": w_layers,
        "probe_accuracy": [float(c.mean()) for c in correct],
        "confused_fraction": float(np.mean(correct[:-1].any(0) & ~correct[-1])),
        "_lss": lss[:, -1],
    }


def separation(clean: np.ndarray, other: np.ndarray) -> float | None:
    """AUROC of a per-sample score between a clean set (0) and another set (1); None if undefined."""
    clean, other = clean[np.isfinite(clean)], other[np.isfinite(other)]
    if not len(clean) or not len(other):
        return None
    truth = np.r_[np.zeros(len(clean)), np.ones(len(other))]
    return float(roc_auc_score(truth, np.r_[clean, other]))


# ---- the run's networks and sets ---------------------------------------------------------------
def _config_attacks(run: RunDir) -> list[dict[str, Any]]:
    """The pipeline config's attack runs (key, attack, params), where the run has a config."""
    if not run.config_file.is_file():
        return []
    return list(artefacts.read_json(run.config_file, what="pipeline config").get("attacks", []))


def _set_label(info: Mapping[str, Any], configured: Sequence[Mapping[str, Any]]) -> str:
    """The config's key of the attack run that made a set (its params a subset of the set's,
    which adds the attack's defaults), else ``<attack>-eps<eps>``."""
    params = info["params"]
    for run in configured:
        wanted = run.get("params", {})
        if run["attack"] == info["attack"] and all(params.get(k) == v for k, v in wanted.items()):
            return str(run["key"])
    eps = params.get("eps")
    return str(info["attack"]) + (f"-eps{eps:g}" if isinstance(eps, int | float) else "")


def cached_sets(run: RunDir, name: str) -> dict[str, Path]:
    """The finished adversarial sets of network ``name`` (never generates one): label -> folder."""
    configured = _config_attacks(run)
    found: dict[str, Path] = {}
    root = run.attacks(name)
    for folder in sorted(root.iterdir() if root.is_dir() else []):
        manifest = folder / adversarial.MANIFEST_FILE
        if folder.suffix == ".partial" or not manifest.is_file():
            continue
        info = artefacts.read_json(manifest, what="adversarial set manifest")
        found.setdefault(_set_label(info, configured), folder)
    return found


def input_fingerprint(run: RunDir, names: Sequence[str], options: DiagnoseOptions) -> dict:
    """What a diagnosis depends on: the code version, options, weights and sets' checksums."""
    sets = {}
    if options.attacks:
        for name in names:
            sets[name] = {
                label: artefacts.read_json(folder / adversarial.MANIFEST_FILE)["arrays_sha256"]
                for label, folder in cached_sets(run, name).items()
            }
    return {
        "version": DIAGNOSE_VERSION,
        "options": options.key(),
        "networks": {n: adversarial.network_sha256(run.model(n)) for n in names},
        "sets": sets,
    }


def diagnose_network(
    run: RunDir,
    name: str,
    options: DiagnoseOptions,
    *,
    root: Path | None = None,
    device: torch.device,
) -> dict[str, Any]:
    """Every measure of network ``name`` on its clean test images and, with ``options.attacks``,
    on the perturbed rows of its cached adversarial sets (their first ``n``)."""
    model = networks.load(run.model(name), device=device)
    probe_x, probe_y, _ = attack_images(
        run.model(name), split="train", n=options.probe_n, seed=1, root=root
    )
    probes = fit_probes(model, probe_x, probe_y, device=device, batch_size=options.batch_size)
    x, y, _ = attack_images(run.model(name), split="test", n=options.n, seed=0, root=root)
    inputs = {CLEAN: (x, y)}
    if options.attacks:
        for label, folder in cached_sets(run, name).items():
            adv = adversarial.load_adversarial_set(folder)
            keep = perturbed(adv)
            inputs[label] = (adv.x_adv[keep][: options.n], adv.labels[keep][: options.n])
    sets: dict[str, dict[str, Any]] = {}
    for label, (images, labels) in inputs.items():
        result = run_set(
            model, probes, images, labels, device=device, batch_size=options.batch_size
        )
        sets[label] = set_statistics(result, ots_n=options.ots_n)
    clean_lss = sets[CLEAN]["_lss"]
    for label, stats in sets.items():
        lss = stats.pop("_lss")
        if label != CLEAN:
            stats["lss_auroc_vs_clean"] = separation(clean_lss, lss)
    return {"blocks": len(sets[CLEAN]["lss_block"]), "sets": sets}


def diagnose_run(
    run_dir: str | Path,
    *,
    model: str | None = None,
    options: DiagnoseOptions | None = None,
    root: Path | None = None,
    device: str = "auto",
    progress: bool = True,
) -> dict[str, Any]:
    """Diagnose the run's networks (or ``model`` alone): write ``diagnostics.json`` and the
    figures; return the diagnostics. Cached: the same networks, sets and options are a no-op."""
    options = options or DiagnoseOptions()
    if options.n < 2 or options.probe_n < 10 or options.ots_n < 2:
        raise ConfigError("diagnose needs n >= 2, probe_n >= 10 and ots_n >= 2")
    run = RunDir(run_dir)
    names = list(run.networks(model))
    fingerprint = input_fingerprint(run, names, options)
    cached = read_diagnostics(run)
    if cached is not None and cached.get("inputs") == fingerprint:
        return cached
    started = time.perf_counter()
    device_t = networks.resolve_device(device)
    result: dict[str, Any] = {"inputs": fingerprint, "networks": {}}
    for name in names:
        if progress:
            print(f"diagnose: {name}", flush=True)
        result["networks"][name] = diagnose_network(run, name, options, root=root, device=device_t)
    result["seconds"] = time.perf_counter() - started
    if cached and "claims" in cached:
        result["claims"] = cached["claims"]
    write_diagnostics(run, result)
    return result


def read_diagnostics(run: RunDir) -> dict[str, Any] | None:
    """The run's diagnostics.json, or None when there is none (or it is unreadable)."""
    path = run.diagnostics_file
    if not path.is_file():
        return None
    try:
        return dict(artefacts.read_json(path, what="diagnostics"))
    except ArtefactError:
        return None


def write_diagnostics(run: RunDir, result: Mapping[str, Any]) -> Path:
    """diagnostics.json and the dynamics figures (the report that shows them is
    :func:`training.reporting.report.refresh_report`'s)."""
    path = artefacts.write_json(run.diagnostics_file, result)
    dynamics_figures(result, run.figures)
    return path


# ---- figures -----------------------------------------------------------------------------------
MEASURES = {
    "lss_block": "LSS of x_0..x_m (seed 001)",
    "ots_block": "OTS of block m (seed 001)",
    "w_layers": "W(layer m, target) (seed 000)",
}


def dynamics_figures(result: Mapping[str, Any], figures: Path) -> dict[str, Path]:
    """``dynamics_networks.png`` (clean images, one line per network) and, when adversarial sets
    were measured, ``dynamics_attacks.png`` (one row per network, clean vs each set)."""
    nets = result.get("networks", {})
    written: dict[str, Path] = {}
    if not nets:
        return written
    by_network = {
        "": {
            title: {name: net["sets"][CLEAN][key] for name, net in nets.items()}
            for key, title in MEASURES.items()
        }
    }
    written[NETWORKS_FIGURE] = plot_block_curves(
        by_network, figures / NETWORKS_FIGURE, clean="", title="Network dynamics, clean test images"
    )
    attacked = {name: net for name, net in nets.items() if len(net["sets"]) > 1}
    if attacked:
        grid = {
            name: {
                title: {label: stats[key] for label, stats in net["sets"].items()}
                for key, title in MEASURES.items()
            }
            for name, net in attacked.items()
        }
        written[ATTACKS_FIGURE] = plot_block_curves(
            grid, figures / ATTACKS_FIGURE, clean=CLEAN, title="Clean vs adversarial tracks"
        )
    return written


# ---- tables ------------------------------------------------------------------------------------
SUMMARY_HEADER = [
    "Network",
    "Set",
    "n",
    "Accuracy",
    "LSS mean / median",
    "OTS per block (mean)",
    "OTS x_0->x_M",
    "W first -> last layer",
    "Confused",
    "LSS AUROC vs clean",
]


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary_rows(result: Mapping[str, Any]) -> list[list[str]]:
    """One row per (network, set) of a diagnosis, in SUMMARY_HEADER's columns."""
    rows = []
    for name, net in result.get("networks", {}).items():
        for label, s in net["sets"].items():
            blocks = [v for v in s["ots_block"] if v is not None]
            rows.append(
                [
                    name,
                    label,
                    str(s["n"]),
                    f"{100 * s['accuracy']:.1f}%",
                    f"{_fmt(s['lss']['mean'])} / {_fmt(s['lss']['median'])}",
                    _fmt(float(np.mean(blocks)) if blocks else None),
                    ", ".join(_fmt(v) for v in s["ots_network"]) or "-",
                    f"{_fmt(s['w_layers'][0])} -> {_fmt(s['w_layers'][-1])}",
                    f"{100 * s['confused_fraction']:.1f}%",
                    _fmt(s.get("lss_auroc_vs_clean")),
                ]
            )
    return rows


CLAIMS_HEADER = ["Claim", "Seed", "Measured here", "Verdict"]


def claim_rows(result: Mapping[str, Any]) -> list[list[str]]:
    """One row per measured claim (the ``diagnose`` preset writes them)."""
    return [
        [c["claim"], c["seed"], c["measured"], "holds" if c["holds"] else "does not hold"]
        for c in result.get("claims", [])
    ]


# ---- the `diagnose` preset -----------------------------------------------------------------------
def run_diagnose_preset(
    config: DiagnoseConfig, run_dir: str | Path, *, root: Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """Train the preset's networks into ``RUN/models/<role>/`` (each cached and resumable, with
    the monitors of its training preset), diagnose them and measure the seeds' claims
    (training/diagnostics/claims.py) into diagnostics.json. Re-running a finished preset is a no-op."""
    run = RunDir(run_dir)
    saved = run.diagnose_config_file
    if saved.is_file():
        previous = artefacts.read_model(saved, DiagnoseConfig, what="diagnose config")
        if previous.model_dump(exclude=NOT_COMPUTED) != config.model_dump(exclude=NOT_COMPUTED):
            raise ConfigError(
                f"{run_dir} holds a run of another diagnose config; choose a new --run"
            )
    else:
        artefacts.write_text(saved, config.model_dump_json(indent=2))
    for role, preset in config.models.items():
        train_config = get_train_preset(preset).model_copy(update={"device": config.device})
        train(train_config, run.model(role), root=root, progress=progress)
    options = DiagnoseOptions(n=config.n, probe_n=config.probe_n, ots_n=config.ots_n)
    result = diagnose_run(
        run.path, options=options, root=root, device=config.device, progress=progress
    )
    claims = measure_claims(result, {role: run.read_metrics(role) for role in config.models})
    if result.get("claims") != claims:
        result["claims"] = claims
        write_diagnostics(run, result)
    return result
