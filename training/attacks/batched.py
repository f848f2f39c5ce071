"""ART's CW-L2, DeepFool and APGD as batched torch code against the network.

ART's ``CarliniL2Method`` and ``DeepFool`` go through ``class_gradient``, which takes one backward
pass per distinct class in the batch (CW twice per step), and ART's DeepFool keeps differentiating
samples that have already flipped. These functions follow ART's algorithms step by step (same
parameters, same line search and binary search, same quirks) but take:

- CW-L2: one backward pass per step, of the margin ``z_true - z_best_other`` itself;
- DeepFool: one backward pass per candidate class, for the still-unflipped samples only;
- APGD-CE: one forward and backward pass per iteration (ART computes the loss of each iterate in
  a second forward pass, and goes through numpy).

Everything is vectorised over the batch; only APGD's random start is random (torch's generator).
Inputs and outputs are float32 NCHW tensors in ``value_range``; ``y`` holds int64 true labels
(CW and APGD are untargeted against them; DeepFool, like ART's, moves each image off the network's
own prediction).
"""

from __future__ import annotations

import math
from typing import TypedDict

import torch
from torch import nn

#: ART's hard-coded constants (CarliniL2Method: arctanh smoother and bound on c; DeepFool: tol).
TANH_SMOOTHER = 0.999999
C_UPPER_BOUND = 10e10
DEEPFOOL_TOL = 10e-8


class TanhBox:
    """ART's change of variables between the value range and tanh space."""

    def __init__(self, low: float, high: float) -> None:
        self.low, self.scale = low, high - low

    def to_tanh(self, x: torch.Tensor) -> torch.Tensor:
        unit = (x.clamp(self.low, self.low + self.scale) - self.low) / self.scale
        return torch.atanh((unit * 2 - 1) * TANH_SMOOTHER)

    def from_tanh(self, w: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(w) + 1.0) / 2.0 * self.scale + self.low

    def chain(self, w: torch.Tensor) -> torch.Tensor:
        """ART's factor from a gradient in the value range to one in tanh space."""
        return self.scale * (1 - torch.tanh(w).square()) / (2 * TANH_SMOOTHER)


def _best_other(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Index of the largest logit other than the true class, per sample."""
    return z.scatter(1, y[:, None], float("-inf")).argmax(1)


class _CWObjective:
    """ART's untargeted CW-L2 objective ``c * max(z_y - z_other + confidence, 0) + ||x' - x||²``."""

    def __init__(self, model: nn.Module, confidence: float) -> None:
        self.model, self.confidence = model, confidence

    @torch.no_grad()
    def __call__(
        self, x: torch.Tensor, x_adv: torch.Tensor, y: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(squared L2 distance, objective) per sample, float64 as in ART."""
        l2 = (x - x_adv).flatten(1).square().sum(1).double()
        z = self.model(x_adv)
        z_true = z.gather(1, y[:, None])[:, 0]
        z_other = z.gather(1, _best_other(z, y)[:, None])[:, 0]
        margin = (z_true - z_other + self.confidence).clamp_min(0).double()
        return l2, c * margin + l2

    def gradient(
        self, x: torch.Tensor, x_adv: torch.Tensor, y: torch.Tensor, c: torch.Tensor
    ) -> torch.Tensor:
        """ART's gradient in the value range: ``c * ∇(z_y - z_other) + 2 (x' - x)`` (the margin
        term is kept even where the hinge is flat, as ART keeps it)."""
        x_adv = x_adv.detach().requires_grad_(True)
        with torch.enable_grad():
            z = self.model(x_adv)
            other = _best_other(z.detach(), y)
            margin = z.gather(1, y[:, None]) - z.gather(1, other[:, None])
            (grad,) = torch.autograd.grad(margin.sum(), x_adv)
        c = c.to(grad.dtype).view(-1, *([1] * (grad.dim() - 1)))
        return c * grad + 2 * (x_adv.detach() - x)


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` (N,) shaped to broadcast over images ``like`` (N, ...), in their dtype."""
    return values.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))


class _CWState:
    """One binary-search step of ART's CW-L2 on a batch: tanh-space iterate and its losses."""

    def __init__(self, attack: CarliniL2, c: torch.Tensor) -> None:
        self.attack, self.c = attack, c
        n = len(attack.x)
        self.lr = torch.full((n,), attack.learning_rate, dtype=torch.float64, device=c.device)
        self.x_adv = attack.x.clone()
        self.w = attack.w0.clone()
        self.l2, self.loss = attack.objective(attack.x, self.x_adv, attack.y, c)
        self.success = self.loss - self.l2 <= 0
        self.overall_success = self.success.clone()

    def _try(self, mask: torch.Tensor, step: torch.Tensor, active: torch.Tensor) -> None:
        """Evaluate the iterate moved by ``lr * step`` for ``mask`` (a subset of ``active``)."""
        a = self.attack
        w = self.w[mask] + _per_sample(self.lr[mask], step) * step[mask[active]]
        self.l2[mask], self.loss[mask] = a.objective(
            a.x[mask], a.box.from_tanh(w), a.y[mask], self.c[mask]
        )

    def line_search(
        self, active: torch.Tensor, step: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ART's halving-then-doubling search of the learning rate: per sample, the best rate
        and that trial's (squared L2, loss), kept so the step need not be evaluated again."""
        prev_loss, best_loss = self.loss.clone(), self.loss.clone()
        best_l2 = self.l2.clone()
        best_lr = torch.zeros_like(self.lr)
        halving = torch.zeros_like(self.lr)

        def keep_better() -> None:
            better = self.loss < best_loss
            best_lr[better], best_loss[better] = self.lr[better], self.loss[better]
            best_l2[better] = self.l2[better]

        for _ in range(self.attack.max_halving):
            do = active & (self.loss >= prev_loss)
            if not do.any():
                break
            self._try(do, step, active)
            keep_better()
            self.lr[do] /= 2
            halving[do] += 1
        self.lr[active] *= 2
        for _ in range(self.attack.max_doubling):
            do = active & (halving == 1) & (self.loss <= best_loss)
            if not do.any():
                break
            self.lr[do] *= 2
            self._try(do, step, active)
            keep_better()
        self.lr[halving == 1] /= 2
        return best_lr, best_l2, best_loss

    def iterate(self, active: torch.Tensor) -> None:
        """One gradient step with line search for the ``active`` samples."""
        a = self.attack
        grad = a.objective.gradient(a.x[active], self.x_adv[active], a.y[active], self.c[active])
        step = -grad * a.box.chain(self.w[active])
        best_lr, best_l2, best_loss = self.line_search(active, step)
        update = active & (best_lr > 0)
        if update.any():
            self.w[update] = (
                self.w[update] + _per_sample(best_lr[update], step) * step[update[active]]
            )
            self.x_adv[update] = a.box.from_tanh(self.w[update])
            # ART evaluates the chosen step once more; it is the best trial's iterate.
            self.l2[update], self.loss[update] = best_l2[update], best_loss[update]
            self.success = self.loss - self.l2 <= 0
            self.overall_success |= self.success


class _CWSettings(TypedDict):
    learning_rate: float
    binary_search_steps: int
    max_iter: int
    initial_const: float
    max_halving: int
    max_doubling: int


class CarliniL2:
    """Untargeted Carlini & Wagner L2 against true labels ``y``: ART's CarliniL2Method on one
    batch, with one backward pass per step. ``CarliniL2(model, x, y, ...).run()`` -> adversarial x."""

    def __init__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        value_range: tuple[float, float],
        confidence: float,
        learning_rate: float,
        binary_search_steps: int,
        max_iter: int,
        initial_const: float,
        max_halving: int,
        max_doubling: int,
    ) -> None:
        self.x, self.y = x, y
        self.box = TanhBox(*value_range)
        self.w0 = self.box.to_tanh(x)
        self.objective = _CWObjective(model, confidence)
        self.learning_rate = learning_rate
        self.max_halving = max_halving
        self.max_doubling = max_doubling
        self.settings: _CWSettings = {
            "learning_rate": learning_rate,
            "binary_search_steps": binary_search_steps,
            "max_iter": max_iter,
            "initial_const": initial_const,
            "max_halving": max_halving,
            "max_doubling": max_doubling,
        }
        n = len(x)
        self.best_l2 = torch.full((n,), float("inf"), dtype=torch.float64, device=x.device)
        self.best_adv = x.clone()

    def _keep_improved(self, state: _CWState) -> None:
        improved = state.success & (state.l2 < self.best_l2)
        self.best_l2[improved] = state.l2[improved]
        self.best_adv[improved] = state.x_adv[improved]

    def run(self) -> torch.Tensor:
        """The best (smallest L2) adversarial image found per sample; the original otherwise."""
        n, device = len(self.x), self.x.device
        c = torch.full((n,), self.settings["initial_const"], dtype=torch.float64, device=device)
        c_lower = torch.zeros_like(c)
        c_double = torch.ones(n, dtype=torch.bool, device=device)
        for _ in range(self.settings["binary_search_steps"]):
            if not (c < C_UPPER_BOUND).any():
                break
            state = _CWState(self, c)
            for _ in range(self.settings["max_iter"]):
                self._keep_improved(state)
                active = (c < C_UPPER_BOUND) & (state.lr > 0)
                if not active.any():
                    break
                state.iterate(active)
            self._keep_improved(state)
            found = state.overall_success
            c_double[found] = False
            c[found] = (c_lower + c)[found] / 2
            # ART aliases its c_old to c_current: failed samples' lower bound is their new c.
            c[~found & c_double] *= 2
            halfway = ~found & ~c_double
            c[halfway] += (c - c_lower)[halfway] / 2
            c_lower[~found] = c[~found]
        return self.best_adv


def _candidate_gradients(
    z: torch.Tensor, x: torch.Tensor, candidates: torch.Tensor
) -> torch.Tensor:
    """Gradients (N, k, ...) of the candidate logits ``z[i, candidates[i, j]]`` w.r.t. ``x``:
    one backward pass per candidate rank, over the whole batch."""
    chosen = z.gather(1, candidates)
    k = chosen.shape[1]
    grads = [
        torch.autograd.grad(chosen[:, j].sum(), x, retain_graph=j < k - 1)[0] for j in range(k)
    ]
    return torch.stack(grads, 1)


def _deepfool_step(
    z: torch.Tensor, grads: torch.Tensor, candidates: torch.Tensor, origin: torch.Tensor
) -> torch.Tensor:
    """DeepFool's linearised step to the nearest candidate boundary (ART's formula and tol)."""
    rows = torch.arange(len(z), device=z.device)
    chosen = z.gather(1, candidates)
    f_diff = chosen - chosen[rows, origin][:, None]
    g_diff = grads - grads[rows, origin][:, None]
    distance = f_diff.abs() / (g_diff.flatten(2).norm(dim=2) + DEEPFOOL_TOL)
    distance[rows, origin] = float("inf")
    nearest = distance.argmin(1)
    direction = g_diff[rows, nearest]
    size = f_diff[rows, nearest].abs() / (direction.flatten(1).norm(dim=1).square() + DEEPFOOL_TOL)
    return _per_sample(size, direction) * direction


def _deepfool_candidates(
    z0: torch.Tensor, predicted: torch.Tensor, nb_grads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidates [N, k], the prediction's column in them): every class in order when
    ``nb_grads`` covers them all, else each image's prediction then its ``nb_grads - 1`` (at
    least one) next most likely classes."""
    n, n_classes = z0.shape
    if nb_grads >= n_classes:
        candidates = torch.arange(n_classes, device=z0.device).expand(n, -1)
        return candidates, predicted
    others = z0.scatter(1, predicted[:, None], float("-inf")).topk(max(nb_grads - 1, 1), 1)
    candidates = torch.cat([predicted[:, None], others.indices], 1)
    return candidates, torch.zeros_like(predicted)


def deepfool(
    model: nn.Module,
    x: torch.Tensor,
    *,
    value_range: tuple[float, float],
    max_iter: int,
    epsilon: float,
    nb_grads: int,
) -> torch.Tensor:
    """DeepFool (ART's steps, scaled by the value range's width, clipped, then the overshoot
    ``epsilon``) off each image's predicted class, towards the nearest boundary among the image's
    own ``nb_grads`` most likely classes at the start (its prediction included), as Foolbox's
    ``candidates``: one backward pass per candidate and step. ART takes the union of those classes
    over the batch, which on a batch of 256 images is every class, so its ``nb_grads`` saves
    nothing there and makes an image's result depend on its batch; per image it does neither.
    With ``nb_grads`` at least the number of classes both are DeepFool over every class."""
    low, high = value_range
    with torch.no_grad():
        z0 = model(x)
    predicted = z0.argmax(1)
    candidates, origin = _deepfool_candidates(z0, predicted, nb_grads)
    x_adv = x.clone()
    active = torch.ones(len(x), dtype=torch.bool, device=x.device)
    for step in range(max_iter + 1):
        idx = active.nonzero()[:, 0]
        current = x_adv[idx].requires_grad_(True)
        with torch.enable_grad():
            z = model(current)
            unflipped = z.argmax(1) == predicted[idx]
            active[idx[~unflipped]] = False
            if step == max_iter or not unflipped.any():
                break
            keep = unflipped.nonzero()[:, 0]
            # Rows of flipped samples get zero gradients: keep only the others.
            grads = _candidate_gradients(z[keep], current, candidates[idx[keep]])[keep]
        r = _deepfool_step(z[keep].detach(), grads, candidates[idx[keep]], origin[idx[keep]])
        moved = current[keep].detach() + r * (high - low)
        x_adv[idx[keep]] = moved.clamp(low, high)
    return (x + (1 + epsilon) * (x_adv - x)).clamp(low, high)


#: ART's APGD constants: momentum, step-halving threshold and the checkpoints' recurrence.
APGD_MOMENTUM = 0.75
APGD_RHO = 0.75


def apgd_checkpoints(max_iter: int) -> list[int]:
    """ART's checkpoints ``w_j`` where APGD may halve a step: the same float recurrence and
    ``ceil`` (0.41 * 100 rounds up to 42 there, as it does here)."""
    var_w = [0.0, 0.22]
    while True:
        p_next = var_w[-1] + max(var_w[-1] - var_w[-2] - 0.03, 0.06)
        if p_next > 1:
            break
        var_w.append(p_next)
    return [math.ceil(p * max_iter) for p in var_w]


class _APGDRun:
    """One APGD-CE run (ART's ``AutoProjectedGradientDescent``, L∞, untargeted) on a batch, with
    one forward and backward pass per iteration: the loss of the next iterate and its gradient
    come from the same pass (ART evaluates the loss in a second forward)."""

    def __init__(
        self,
        model: nn.Module,
        x_init: torch.Tensor,
        y: torch.Tensor,
        *,
        eps: float,
        eps_step: float,
        value_range: tuple[float, float],
    ) -> None:
        self.model, self.x_init, self.y, self.eps = model, x_init, y, eps
        self.low, self.high = value_range
        self.eta = torch.full((len(x_init),), eps_step, dtype=x_init.dtype, device=x_init.device)

    def loss_and_grad(
        self, x: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample cross-entropy at ``x`` (the batch's ``rows``, all by default) and the sign
        of its gradient."""
        y = self.y if rows is None else self.y[rows]
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            loss = nn.functional.cross_entropy(self.model(x), y, reduction="none")
            (grad,) = torch.autograd.grad(loss.sum(), x)
        return loss.detach(), grad.sign()

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Clip to the value range, then onto the ε-ball around the start."""
        x = x.clamp(self.low, self.high)
        return self.x_init + (x - self.x_init).clamp(-self.eps, self.eps)

    def run(self, x_k: torch.Tensor, max_iter: int) -> torch.Tensor:
        """ART's iterations from the (randomly started) ``x_k``: the last iterate."""
        checkpoints = apgd_checkpoints(max_iter)
        f_0, grad = self.loss_and_grad(x_k)
        x_1 = self.project(x_k + _per_sample(self.eta, x_k) * grad)
        f_1, grad = self.loss_and_grad(x_1)
        better = f_1 >= f_0
        count = better.to(x_k.dtype)
        f_max, x_max = (
            torch.where(better, f_1, f_0),
            torch.where(_per_sample(better, x_k) > 0, x_1, x_k),
        )
        x_max_prev = self.x_init.clone()
        eta_then, f_max_then = self.eta.clone(), f_0.clone()
        x_prev, x_k = x_k, x_1
        for k in range(1, max_iter):
            z = self.project(x_k + _per_sample(self.eta, x_k) * grad)
            x_next = x_k + APGD_MOMENTUM * (z - x_k) + (1 - APGD_MOMENTUM) * (x_k - x_prev)
            x_next = self.project(x_next)
            f_next, grad = self.loss_and_grad(x_next)
            if bool((f_next == 0).all()):
                return x_next
            better = f_next > f_max
            count += better.to(count.dtype)
            x_max[better], x_max_prev[better], f_max[better] = (
                x_next[better],
                x_k[better],
                f_next[better],
            )
            x_prev, x_k = x_k, x_next
            if k in checkpoints:
                since = k - checkpoints[checkpoints.index(k) - 1]
                halve = (count < APGD_RHO * since) | (
                    (eta_then == self.eta) & (f_max_then == f_max)
                )
                self.eta[halve] /= 2
                x_k, x_prev = x_k.clone(), x_prev.clone()
                x_k[halve], x_prev[halve] = x_max[halve], x_max_prev[halve]
                if halve.any():
                    grad = grad.clone()
                    grad[halve] = self.loss_and_grad(x_k[halve], halve)[1]
                count.zero_()
                eta_then, f_max_then = self.eta.clone(), f_max.clone()
        return x_k


def apgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    value_range: tuple[float, float],
    eps: float,
    eps_step: float,
    max_iter: int,
    nb_random_init: int,
) -> torch.Tensor:
    """Untargeted APGD-CE under L∞ against true labels ``y``: ART's algorithm on one batch. Each
    restart attacks the images still classified as ``y``, from a uniform random draw in the
    ε-ball around its previous start (the image at first), projected onto the ε-ball around the
    image; an image whose last iterate fools the network takes it, the others keep their start,
    and an image already misclassified comes back unchanged (all as ART)."""
    x_adv = x.clone()
    for _ in range(max(1, nb_random_init)):
        with torch.no_grad():
            robust = (model(x_adv).argmax(1) == y).nonzero()[:, 0]
        if len(robust) == 0:
            break
        x_init = x[robust]
        noise = torch.rand(x_init.shape, device=x.device, dtype=x.dtype)
        start = x_adv[robust] + (noise * 2 - 1) * eps  # ART: around the previous start
        attack = _APGDRun(
            model, x_init, y[robust], eps=eps, eps_step=eps_step, value_range=value_range
        )
        start = attack.project(start)
        last = attack.run(start, max_iter)
        with torch.no_grad():
            fooled = model(last).argmax(1) != y[robust]
        x_adv[robust] = torch.where(_per_sample(fooled, last) > 0, last, start)
    return x_adv
