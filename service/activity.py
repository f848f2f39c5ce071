"""Recent scoring activity of this process, for the page's live panel (``GET /v1/stats``).

Bounded: the last :data:`MAX_REQUESTS` requests and :data:`MAX_SCORES` image scores, each with
its time, in deques; a read summarizes the window asked for. Prometheus' ``/metrics`` stays the
source for real monitoring; this answers "what is happening now" without a Prometheus server.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

MAX_REQUESTS = 20_000
MAX_SCORES = 20_000
HISTOGRAM_BINS = 24


class RecentActivity:
    """Requests and scores of the last minutes (thread-safe, O(1) per record)."""

    def __init__(self, max_requests: int = MAX_REQUESTS, max_scores: int = MAX_SCORES) -> None:
        self._requests: deque[tuple[float, int, int]] = deque(maxlen=max_requests)
        self._scores: deque[tuple[float, float, bool]] = deque(maxlen=max_scores)
        self._lock = threading.Lock()

    def record(self, scores: np.ndarray, flagged: np.ndarray, now: float | None = None) -> None:
        """One scored request: its images' scores and flags."""
        now = time.time() if now is None else now
        with self._lock:
            self._requests.append((now, len(scores), int(np.count_nonzero(flagged))))
            self._scores.extend(
                (now, float(s), bool(f)) for s, f in zip(scores, flagged, strict=True)
            )

    def summary(
        self, window_s: float, bucket_s: float, now: float | None = None
    ) -> dict[str, object]:
        """Counts, rates, per-bucket series and the score histogram of the last ``window_s``."""
        now = time.time() if now is None else now
        since = now - window_s
        with self._lock:
            requests = [r for r in self._requests if r[0] > since]
            scores = [s for s in self._scores if s[0] > since]
        n_buckets = max(1, int(np.ceil(window_s / bucket_s)))
        starts = since + bucket_s * np.arange(n_buckets)
        buckets = np.zeros((n_buckets, 3), np.int64)
        for t, images, flagged in requests:
            row = min(int((t - since) // bucket_s), n_buckets - 1)
            buckets[row] += (1, images, flagged)
        images = int(buckets[:, 1].sum())
        flagged = int(buckets[:, 2].sum())
        return {
            "window_s": window_s,
            "bucket_s": bucket_s,
            "requests": len(requests),
            "images": images,
            "flagged": flagged,
            "request_rate": len(requests) / window_s,
            "flag_rate": flagged / images if images else None,
            "buckets": [
                {"start": float(start), "requests": int(r), "images": int(i), "flagged": int(f)}
                for start, (r, i, f) in zip(starts, buckets, strict=True)
            ],
            "histogram": _histogram(scores),
        }


def _histogram(scores: list[tuple[float, float, bool]]) -> dict[str, list]:
    """Counts of the scores (and of the flagged ones) in :data:`HISTOGRAM_BINS` equal bins."""
    if not scores:
        return {"edges": [], "counts": [], "flagged": []}
    values = np.array([s[1] for s in scores], np.float64)
    flags = np.array([s[2] for s in scores], bool)
    low, high = float(values.min()), float(values.max())
    if high <= low:
        low, high = low - 0.5, high + 0.5
    edges = np.linspace(low, high, HISTOGRAM_BINS + 1)
    counts, _ = np.histogram(values, edges)
    flagged, _ = np.histogram(values[flags], edges)
    return {"edges": edges.tolist(), "counts": counts.tolist(), "flagged": flagged.tolist()}
