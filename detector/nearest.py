"""Nearest clean samples: the distance of inputs to their nearest clean fitting row, and the
share of clean fitting rows whose own distance is at most an input's (its clean CDF). The
clean-only parts that measure a nearest distance (:mod:`detector.novelty` on the whitened
trajectory features, :mod:`detector.penultimate` on the penultimate embedding) share them."""

from __future__ import annotations

import torch

from detector.errors import InputError

_CHUNK = 1024  # rows per distance block (the nearest-sample distance is [chunk, N_clean])


def nearest_distance(
    queries: torch.Tensor,
    points: torch.Tensor,
    *,
    exclude_self: bool = False,
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Squared Euclidean distance of each query row to its nearest row of ``points`` (the
    second nearest with ``exclude_self``: the queries ARE the points), in blocks of rows.
    ``groups``: (the queries' group ids [Q], the points' [P]); a point of a query's own group
    is never its nearest (inf when every point is of its group)."""
    k = 2 if exclude_self else 1
    if len(points) < k:
        raise InputError(f"the nearest-sample distance needs at least {k} clean samples")
    if groups is not None and (
        groups[0].shape != queries.shape[:1] or groups[1].shape != points.shape[:1]
    ):
        raise InputError("groups must give one id per query row and one per point")
    out = []
    for start in range(0, len(queries), _CHUNK):
        block = queries[start : start + _CHUNK]
        distance = torch.cdist(block, points, compute_mode="donot_use_mm_for_euclid_dist")
        if groups is not None:
            own = groups[0][start : start + _CHUNK, None] == groups[1][None, :]
            distance = distance.masked_fill(own, torch.inf)
        out.append(distance.topk(k, dim=1, largest=False).values[:, k - 1])
    return torch.cat(out).square() if out else queries.new_zeros(0)


def clean_cdf(reference: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """Share of the sorted clean ``reference`` distances at most each ``distance``, float32 in
    [0, 1]: about uniform on clean inputs, 1 beyond every clean sample."""
    rank = torch.searchsorted(reference, distance.contiguous(), right=True)
    return rank.to(torch.float32) / reference.numel()
