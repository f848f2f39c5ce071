"""Network dynamics in Wasserstein space, measured on the same taps the detector uses.

* Seed 001/002 (geodesic curve): the line-shape ratio and score (LSR, LSS; eq. 42-44) of data
  tracks x(0) -> ... -> x(n), and the optimal transport score (OTS; eq. 45-47) of a learned map.
* Seed 000 (layer behaviours): the W-distance between a predicted label distribution and the
  target one under a ground cost between labels (eq. 2), per layer (across layers) or per
  checkpoint (one layer across training), averaged over samples (the loss of eq. 1).
* Seed 004 (internal covariate shift): the EM distance between a layer's output distributions
  at two training steps (eq. 2), exact on equal-size samples.

Everything works on numpy arrays; :func:`block_states` and :func:`data_tracks` read a network's
block states x_0..x_M through :class:`detector.taps.Taps` (one ordinary forward pass). Exact
optimal transport between two equal-size uniform samples is an assignment problem, solved with
``scipy.optimize.linear_sum_assignment`` (Jonker-Volgenant, as in seed 001).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from scipy.linalg import sqrtm
from scipy.optimize import linear_sum_assignment, linprog
from scipy.spatial.distance import cdist
from torch import nn

from detector.errors import InputError
from detector.taps import Tap, Taps, default_tap_names


# --------------------------------------------------------------------------------------------
# Optimal transport between samples
# --------------------------------------------------------------------------------------------
def _as_samples(x: np.ndarray, name: str) -> np.ndarray:
    samples = np.asarray(x, dtype=np.float64)
    if samples.ndim == 1:
        samples = samples[:, None]
    if len(samples) == 0:
        raise InputError(f"{name} must be a non-empty [N, ...] array, got {samples.shape}")
    return samples.reshape(len(samples), -1)


def _equal_size(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = _as_samples(x, "x"), _as_samples(y, "y")
    if xs.shape != ys.shape:
        raise InputError(f"x and y need the same [N, d] shape, got {xs.shape} and {ys.shape}")
    return xs, ys


def _cost_matrix(xs: np.ndarray, ys: np.ndarray, p: float) -> np.ndarray:
    """||x_i - y_j||^p; for p = 2 through one matrix product (wide samples: network states)."""
    if p != 2.0:
        return np.asarray(cdist(xs, ys) ** p)
    squared = (xs**2).sum(1)[:, None] + (ys**2).sum(1)[None, :] - 2.0 * xs @ ys.T
    return np.maximum(squared, 0.0)


def optimal_assignment(x: np.ndarray, y: np.ndarray, *, p: float = 2.0) -> np.ndarray:
    """The permutation sigma minimising sum_i ||x_i - y_sigma(i)||^p (seed 001, eq. 46 for p=2).

    Returns ``sigma`` as an int array: x_i is transported to y_{sigma[i]}.
    """
    xs, ys = _equal_size(x, y)
    _, sigma = linear_sum_assignment(_cost_matrix(xs, ys, p))
    return np.asarray(sigma, dtype=np.int64)


def wasserstein_samples(x: np.ndarray, y: np.ndarray, *, p: float = 2.0) -> float:
    """Exact W_p between the uniform empirical distributions of two equal-size samples.

    W_p^p = min_sigma (1/m) sum_i ||x_i - y_sigma(i)||^p (seed 001, eq. 45 for p = 2; seed 004,
    eq. 2 for p = 1). Samples are [N, d] (or [N]; further axes are flattened).
    """
    xs, ys = _equal_size(x, y)
    sigma = optimal_assignment(xs, ys, p=p)
    distances = np.linalg.norm(xs - ys[sigma], axis=1)
    return float(np.mean(distances**p) ** (1.0 / p))


def gaussian_wasserstein(
    mean_a: np.ndarray, cov_a: np.ndarray, mean_b: np.ndarray, cov_b: np.ndarray
) -> float:
    """Closed-form W_2 between N(mean_a, cov_a) and N(mean_b, cov_b) (seed 000, Proposition 3):
    W^2 = ||m_a - m_b||^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2)."""
    mean_a, mean_b = np.atleast_1d(mean_a).astype(float), np.atleast_1d(mean_b).astype(float)
    cov_a, cov_b = np.atleast_2d(cov_a).astype(float), np.atleast_2d(cov_b).astype(float)
    root_a = np.real(sqrtm(cov_a))
    cross = np.real(sqrtm(root_a @ cov_b @ root_a))
    squared = np.sum((mean_a - mean_b) ** 2) + np.trace(cov_a + cov_b - 2 * cross)
    return float(np.sqrt(max(squared, 0.0)))


# --------------------------------------------------------------------------------------------
# Seed 001/002: line shape of data tracks and the optimal transport score
# --------------------------------------------------------------------------------------------
def _as_tracks(tracks: np.ndarray) -> np.ndarray:
    array = np.asarray(tracks, dtype=np.float64)
    if array.ndim == 2:
        array = array[None]
    if array.ndim < 3 or array.shape[1] < 2:
        raise InputError(
            f"tracks must be [N, n+1, d] (or one [n+1, d] track) with n >= 1, got {array.shape}"
        )
    return array.reshape(array.shape[0], array.shape[1], -1)


def line_shape_ratio(tracks: np.ndarray) -> np.ndarray:
    """LSR = sum_l ||x(l+1) - x(l)|| / ||x(n) - x(0)|| per track (seed 001, eq. 42); >= 1.

    ``tracks`` is [N, n+1, d] (or a single [n+1, d] track); returns [N] (inf for closed tracks).
    """
    array = _as_tracks(tracks)
    length = np.linalg.norm(np.diff(array, axis=1), axis=2).sum(1)
    chord = np.linalg.norm(array[:, -1] - array[:, 0], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(chord > 0, length / np.where(chord > 0, chord, 1.0), np.inf)


def line_shape_score(tracks: np.ndarray) -> np.ndarray:
    """LSS = n / ||x~(n) - x~(0)|| with x~(l) = x~(l-1) + unit(x(l) - x(l-1)) (seed 001, eq. 43-44).

    Per track: >= 1, and 1 exactly when the track runs along a straight line in one direction.
    A zero-length segment adds no step (its direction is undefined), as in
    :meth:`detector.features.TransportFeatureExtractor.line_shape_score`. Returns [N].
    """
    array = _as_tracks(tracks)
    steps = np.diff(array, axis=1)
    norms = np.linalg.norm(steps, axis=2, keepdims=True)
    units = np.where(norms > 0, steps / np.where(norms > 0, norms, 1.0), 0.0)
    span = np.linalg.norm(units.sum(1), axis=1)
    n = steps.shape[1]
    return n / np.maximum(span, 1e-12)


def optimal_transport_score(inputs: np.ndarray, outputs: np.ndarray) -> float:
    """OTS = #{i : sigma(i) = i} / m (seed 001, eq. 47), sigma the quadratic-cost optimal
    assignment of the inputs x_i to the outputs f(x_i) (eq. 45-46).

    1 when the map x_i -> f(x_i) is itself the optimal transport map between the two samples;
    ``inputs[i]`` and ``outputs[i]`` must be the same sample before and after the map.
    """
    sigma = optimal_assignment(inputs, outputs, p=2.0)
    return float(np.mean(sigma == np.arange(len(sigma))))


# --------------------------------------------------------------------------------------------
# Seed 000: W-distance between label distributions, across layers and across training
# --------------------------------------------------------------------------------------------
def label_cost(num_classes: int, *, kind: str = "discrete", p: float = 1.0) -> np.ndarray:
    """Ground cost C[k, k'] = d(k, k')^p between label tags (seed 000, Definition 1).

    ``discrete``: d = 1 for k != k' (then W is the total variation distance);
    ``ordinal``: d = |k - k'| (then W_1 is the L1 distance between the cumulative histograms).
    """
    labels = np.arange(num_classes, dtype=np.float64)
    if kind == "discrete":
        distance = (labels[:, None] != labels[None, :]).astype(np.float64)
    elif kind == "ordinal":
        distance = np.abs(labels[:, None] - labels[None, :])
    else:
        raise InputError(f"unknown label cost {kind!r}; choose discrete or ordinal")
    return distance**p


def _check_histograms(name: str, histograms: np.ndarray, num_classes: int) -> np.ndarray:
    array = np.asarray(histograms, dtype=np.float64)
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2 or array.shape[1] != num_classes:
        raise InputError(f"{name} must be [N, {num_classes}] histograms, got {array.shape}")
    if np.any(array < -1e-9) or not np.allclose(array.sum(1), 1.0, atol=1e-6):
        raise InputError(f"{name} rows must be probability vectors (non-negative, summing to 1)")
    return np.clip(array, 0.0, None) / np.clip(array, 0.0, None).sum(1, keepdims=True)


def label_wasserstein(predicted: np.ndarray, target: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """W(mu_hat, mu) = min_{T 1 = mu_hat, T^T 1 = mu, T >= 0} <T, C> per sample (seed 000, eq. 2).

    ``predicted`` and ``target`` are [N, K] histograms (or one [K] each), ``cost`` the [K, K]
    ground cost (:func:`label_cost`). Solved exactly as a linear programme. Returns [N].
    """
    cost = np.asarray(cost, dtype=np.float64)
    k = cost.shape[0]
    if cost.shape != (k, k):
        raise InputError(f"cost must be a square [K, K] matrix, got {cost.shape}")
    predicted = _check_histograms("predicted", predicted, k)
    target = _check_histograms("target", target, k)
    if predicted.shape != target.shape:
        raise InputError(f"predicted {predicted.shape} and target {target.shape} differ in shape")
    # Row sums (T 1 = mu_hat) and column sums (T^T 1 = mu); the last column constraint is
    # implied by the others, so it is left out to keep the system full rank.
    rows = np.kron(np.eye(k), np.ones((1, k)))
    cols = np.kron(np.ones((1, k)), np.eye(k))[:-1]
    constraints = np.vstack([rows, cols])
    distances = np.empty(len(predicted))
    for i, (mu_hat, mu) in enumerate(zip(predicted, target, strict=True)):
        result = linprog(
            cost.ravel(),
            A_eq=constraints,
            b_eq=np.concatenate([mu_hat, mu[:-1]]),
            bounds=(0, None),
            method="highs",
        )
        if not result.success:
            raise InputError(f"label transport problem {i} has no solution: {result.message}")
        distances[i] = result.fun
    return distances


def dirac_label_wasserstein(
    predicted: np.ndarray, labels: np.ndarray, cost: np.ndarray
) -> np.ndarray:
    """W(mu_hat, delta_y) = sum_k mu_hat[k] C[k, y] per sample (seed 000, eq. 2 with a one-hot
    target): the only coupling sends all mass to the label y, so no programme is solved.
    ``predicted`` is [N, K], ``labels`` [N] ints; with the discrete cost this is 1 - mu_hat[y]."""
    cost = np.asarray(cost, dtype=np.float64)
    predicted = _check_histograms("predicted", predicted, cost.shape[0])
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (len(predicted),):
        raise InputError(
            f"need one label per row of predicted: {labels.shape} vs {predicted.shape}"
        )
    return np.einsum("nk,nk->n", predicted, cost[:, labels].T)


def layer_label_distances(
    layer_predictions: Sequence[np.ndarray], target: np.ndarray, cost: np.ndarray
) -> np.ndarray:
    """Mean W-distance to the target for each entry of ``layer_predictions`` (seed 000, eq. 1-2).

    Pass one [N, K] histogram array per layer (the probe heads' outputs) for the across-layer
    curve W(mu_1, mu), ..., W(mu_L, mu), or one per checkpoint of a layer for the
    single-layer curve across training. Returns [len(layer_predictions)].
    """
    return np.array([float(np.mean(label_wasserstein(p, target, cost))) for p in layer_predictions])


def probe_predictions(
    model: nn.Module,
    x: torch.Tensor,
    probes: Sequence[nn.Module],
    *,
    tap_names: Sequence[str] | None = None,
) -> list[np.ndarray]:
    """The label distribution each block's probe head predicts (seed 000, Figure 1(a): h_l):
    softmax(probes[m](x_{m+1})) on the output of block m, one [N, K] array per probe.

    Probes take the block output in its own shape (e.g. pooling + linear); they are trained
    elsewhere, with the network frozen. Feed the result to :func:`layer_label_distances`.
    """
    states = _block_tensors(model, x, tap_names)[1:]
    if len(probes) != len(states):
        raise InputError(f"need one probe per block: {len(states)} blocks, {len(probes)} probes")
    with torch.no_grad():
        return [
            torch.softmax(probe(state), dim=1).double().cpu().numpy()
            for probe, state in zip(probes, states, strict=True)
        ]


# --------------------------------------------------------------------------------------------
# Seed 004: internal covariate shift as an EM distance
# --------------------------------------------------------------------------------------------
def internal_covariate_shift(outputs_before: np.ndarray, outputs_after: np.ndarray) -> float:
    """ICS = W(p_l^(t+dt), p_l^(t)), the EM (W_1) distance between a layer's outputs on the same
    inputs at two training steps (seed 004, eq. 2), exact on the samples. [N, ...] arrays."""
    return wasserstein_samples(outputs_after, outputs_before, p=1.0)


# --------------------------------------------------------------------------------------------
# Tapped networks
# --------------------------------------------------------------------------------------------
def block_names(model: nn.Module, tap_names: Sequence[str] | None = None) -> list[str]:
    """The residual blocks of a model: the parent module of each residual tap, in depth order."""
    names = list(tap_names) if tap_names is not None else default_tap_names(model)
    return [name.rsplit(".", 1)[0] if "." in name else "" for name in names]


def block_tensors(
    model: nn.Module, x: torch.Tensor, tap_names: Sequence[str] | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(states, logits) from one forward pass without gradients: x_0 (the first block's input)
    and each block's output in their own shapes (M+1 detached tensors), and the model's output."""
    blocks = block_names(model, tap_names)
    taps = [Tap(blocks[0], "input")] + [Tap(name, "output") for name in blocks]
    with torch.no_grad(), Taps(model, taps, transform=torch.Tensor.detach) as tapped:
        logits = model(x)
        return list(tapped.outputs), logits.detach()


def batched_block_tensors(
    model: nn.Module, x: np.ndarray, *, device: torch.device | str, batch_size: int
) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
    """:func:`block_tensors` of ``x`` (a numpy [N, ...] array) batch by batch, in order."""
    for start in range(0, len(x), batch_size):
        yield block_tensors(model, torch.from_numpy(x[start : start + batch_size]).to(device))


def _block_tensors(
    model: nn.Module, x: torch.Tensor, tap_names: Sequence[str] | None
) -> list[torch.Tensor]:
    return block_tensors(model, x, tap_names)[0]


def block_states(
    model: nn.Module, x: torch.Tensor, *, tap_names: Sequence[str] | None = None
) -> list[np.ndarray]:
    """x_0 (the first block's input) and x_1..x_M (each block's output), flattened: M+1 arrays
    [N, d_m] from one forward pass without gradients. The model's mode is left as it is."""
    return [_flat(state) for state in _block_tensors(model, x, tap_names)]


def _flat(state: torch.Tensor) -> np.ndarray:
    return state.flatten(1).double().cpu().numpy()


def data_tracks(
    model: nn.Module, x: torch.Tensor, *, tap_names: Sequence[str] | None = None
) -> list[np.ndarray]:
    """The data tracks of a network, one [N, n+1, d] array per stage (seed 001, Definition 2).

    A stage is a maximal run of consecutive block states of one shape; a block that
    changes the shape (the P_k of seed 001, eq. 16) starts a new stage at its output.
    """
    states = _block_tensors(model, x, tap_names)
    stages: list[list[torch.Tensor]] = [[states[0]]]
    for state in states[1:]:
        if state.shape == stages[-1][-1].shape:
            stages[-1].append(state)
        else:
            stages.append([state])
    return [np.stack([_flat(s) for s in stage], axis=1) for stage in stages if len(stage) > 1]


def network_line_shape(
    model: nn.Module, x: torch.Tensor, *, tap_names: Sequence[str] | None = None
) -> list[np.ndarray]:
    """LSS (seed 001, eq. 43-44) of every sample's track, per stage: a list of [N] arrays."""
    return [line_shape_score(track) for track in data_tracks(model, x, tap_names=tap_names)]


def network_transport_score(
    model: nn.Module, x: torch.Tensor, *, tap_names: Sequence[str] | None = None
) -> list[float]:
    """OTS (seed 001, eq. 47) of the map each stage learns, from its first to its last state."""
    tracks = data_tracks(model, x, tap_names=tap_names)
    return [optimal_transport_score(track[:, 0], track[:, -1]) for track in tracks]


def layer_outputs(model: nn.Module, x: torch.Tensor, module: str) -> np.ndarray:
    """The output of module ``module`` on ``x``, flattened per sample: [N, d], no gradients."""
    with torch.no_grad(), Taps(model, [module], transform=lambda t: t.detach().flatten(1)) as tap:
        model(x)
        (output,) = tap.outputs
    return output.double().cpu().numpy()


def layer_covariate_shift(
    model_before: nn.Module, model_after: nn.Module, x: torch.Tensor, module: str
) -> float:
    """ICS of layer ``module`` between two snapshots of one network (seed 004, eq. 2), on the
    same inputs ``x``; the models' modes (train/eval) are left as they are."""
    return internal_covariate_shift(
        layer_outputs(model_before, x, module), layer_outputs(model_after, x, module)
    )
