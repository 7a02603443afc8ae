"""Drift monitoring of one served version: the reviews it answered, against the baseline that
export wrote beside it (`common.drift`), over two rolling windows: the last `window_reviews`
reviews, and the reviews of the last `window_seconds` seconds.

The model call hands over its outputs (`observe`, in the model thread); they are only queued there.
Binning them is numpy over many reviews at once, when FLUSH_ROWS have queued up or someone reads
the windows (a scrape, the monitoring endpoint), so a request pays for an append, not for the
statistics. Each window keeps its bin counts, so reading one costs the number of bins.

With `--workers N` each worker keeps its own windows; `counts()` is what a sibling sends, and
`Report` sums the counts of every worker before scoring them, so the endpoint's figures are the
server's and each worker's own score is beside them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Mapping

import numpy as np

from common.drift import (
    DESCRIPTIONS,
    DRIFT_THRESHOLD,
    LOW_CONFIDENCE,
    MIN_REVIEWS,
    SHORT_NAMES,
    STATISTICS,
    Baseline,
    low_confidence,
    review_statistics,
)

log = logging.getLogger(__name__)

FLUSH_ROWS = 2048
"""Queued reviews binned at once."""
FLAGS = ("unlike_training", "low_confidence")
"""Two more columns of 0/1 per review, counted like the statistics' bins."""
WINDOWS = ("reviews", "seconds")
_SUMMED = ("words", "unknown_ngram_share", "positive_probability")
"""The statistics whose lifetime sums the Prometheus histograms report."""


def _column_sizes(baseline: Baseline) -> list[int]:
    """Bins of each column a review is counted in: the statistics', then two per flag."""
    return [len(baseline.edges[name]) + 1 for name in STATISTICS] + [2] * len(FLAGS)


class VersionMonitor:
    """The rolling windows of one model version (thread-safe: observed in the model thread, read
    on the event loop)."""

    def __init__(self, baseline: Baseline, window_reviews: int, window_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.baseline = baseline
        self.window_reviews, self.window_seconds = window_reviews, window_seconds
        self._clock = clock
        sizes = _column_sizes(baseline)
        self._offsets = np.cumsum([0, *sizes[:-1]])
        self.bins = int(sum(sizes))
        self._lock = threading.Lock()
        self._pending: list[tuple[int, Mapping[str, np.ndarray]]] = []
        self._pending_rows = 0
        self._ring = np.zeros((window_reviews, len(sizes)), np.int32)
        self._filled = self._next = 0
        self._recent = np.zeros(self.bins, np.int64)
        """Bin counts of the last window_reviews reviews."""
        self._seconds: collections.deque[list] = collections.deque()
        """[second, bin counts] of each second with reviews, oldest first."""
        self._total = np.zeros(self.bins, np.int64)
        self._sums = dict.fromkeys(_SUMMED, 0.0)

    def observe(self, outputs: Mapping[str, np.ndarray]) -> None:
        """One model call's outputs (probabilities and `common.drift.COUNT_OUTPUTS`)."""
        rows = len(outputs["probabilities"])
        with self._lock:
            self._pending.append((int(self._clock()), outputs))
            self._pending_rows += rows
            if self._pending_rows >= FLUSH_ROWS:
                self._flush()

    def counts(self) -> dict:
        """The windows' bin counts, flat (see `Report`), plain JSON."""
        with self._lock:
            self._flush()
            self._expire()
            seconds = np.sum([c for _, c in self._seconds], axis=0) if self._seconds else np.zeros(self.bins, np.int64)
            return {"reviews": self._recent.tolist(), "seconds": seconds.tolist(), "total": self._total.tolist(),
                    "sums": dict(self._sums)}

    # -- inside the lock ----------------------------------------------------------------------------

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending, self._pending_rows = self._pending, [], 0
        seconds = np.concatenate([np.full(len(o["probabilities"]), s) for s, o in pending])
        joined = {name: np.concatenate([o[name] for _, o in pending])
                  for name in ("probabilities", "words", "ngrams", "known_ngrams")}
        statistics = review_statistics(joined, joined["probabilities"])
        bins = self.baseline.bins(statistics)
        positive = statistics["positive_probability"]
        columns = [bins[name] for name in STATISTICS] + [
            self.baseline.unlike(statistics).astype(np.int64),
            low_confidence(positive).astype(np.int64)]
        flat = np.stack(columns, axis=1) + self._offsets
        for name in _SUMMED:
            self._sums[name] += float(statistics[name].sum())
        self._total += np.bincount(flat.ravel(), minlength=self.bins)
        self._add_recent(flat)
        for second in np.unique(seconds):
            counts = np.bincount(flat[seconds == second].ravel(), minlength=self.bins)
            if self._seconds and self._seconds[-1][0] == second:
                self._seconds[-1][1] += counts
            else:
                self._seconds.append([int(second), counts])
        self._expire()

    def _add_recent(self, flat: np.ndarray) -> None:
        size = self.window_reviews
        if len(flat) >= size:
            self._ring[:] = flat[-size:]
            self._recent = np.bincount(self._ring.ravel(), minlength=self.bins)
            self._filled, self._next = size, 0
            return
        slots = (self._next + np.arange(len(flat))) % size
        occupied = slots < self._filled if self._filled < size else np.ones(len(flat), bool)
        self._recent -= np.bincount(self._ring[slots[occupied]].ravel(), minlength=self.bins)
        self._recent += np.bincount(flat.ravel(), minlength=self.bins)
        self._ring[slots] = flat
        self._next = int((self._next + len(flat)) % size)
        self._filled = min(size, self._filled + len(flat))

    def _expire(self) -> None:
        oldest = self._clock() - self.window_seconds
        while self._seconds and self._seconds[0][0] <= oldest:
            self._seconds.popleft()


class Report:
    """Scores of windows' bin counts (one worker's, or several summed) against a baseline."""

    def __init__(self, baseline: Baseline, counts: list[dict]) -> None:
        self.baseline = baseline
        sizes = _column_sizes(baseline)
        self._slices = dict(zip([*STATISTICS, *FLAGS],
                                (slice(a, a + n) for a, n in zip(np.cumsum([0, *sizes[:-1]]), sizes))))
        self.counts = {key: np.sum([np.asarray(c[key], np.int64) for c in counts], axis=0)
                       for key in (*WINDOWS, "total")}
        self.sums = {name: float(sum(c["sums"][name] for c in counts)) for name in _SUMMED}

    def of(self, window: str, name: str) -> np.ndarray:
        """Bin counts of statistic (or flag) `name` in `window` (reviews, seconds or total)."""
        return self.counts[window][self._slices[name]]

    def reviews(self, window: str) -> int:
        return int(self.of(window, STATISTICS[0]).sum())

    def psi(self, window: str) -> dict[str, float]:
        return {name: self.baseline.psi(name, self.of(window, name)) for name in STATISTICS}

    def share(self, window: str, flag: str) -> float | None:
        reviews = self.reviews(window)
        return float(self.of(window, flag)[1]) / reviews if reviews else None

    def window(self, window: str, seconds: float | None = None, size: int | None = None) -> dict:
        """One window as JSON: its reviews, each statistic's shares and PSI, the flags, a verdict."""
        reviews, psi, b = self.reviews(window), self.psi(window), self.baseline
        statistics = {}
        for name in STATISTICS:
            counts = self.of(window, name)
            statistics[name] = {"psi": round(psi[name], 4),
                                "shares": [round(float(c) / reviews, 4) if reviews else 0.0 for c in counts],
                                "baseline_shares": list(b.shares[name])}
        unlike, low = self.share(window, "unlike_training"), self.share(window, "low_confidence")
        drifting = [name for name in STATISTICS if psi[name] > DRIFT_THRESHOLD]
        if reviews < MIN_REVIEWS:
            verdict, line = "warming_up", f"not judged yet: {reviews} of the {MIN_REVIEWS} reviews needed"
        elif drifting:
            verdict = "drifting"
            line = (f"drifting: {100 * unlike:.0f}% of reviews unlike training (held-out reviews: "
                    f"{100 * b.unlike_share:.0f}%); shifted: {', '.join(SHORT_NAMES[n] for n in drifting)}")
        else:
            verdict, line = "ok", (f"looks like training data: {100 * unlike:.0f}% of reviews unlike training "
                                   f"(held-out reviews: {100 * b.unlike_share:.0f}%)")
        out = {"reviews": reviews, "verdict": verdict, "summary": line, "drift_threshold": DRIFT_THRESHOLD,
               "unlike_training_share": unlike, "low_confidence_share": low, "statistics": statistics}
        if seconds is not None:
            out["seconds"] = seconds
        if size is not None:
            out["size"] = size
        return out


def describe(version: int, state: str, baseline: Baseline | None, by_worker: Mapping[int, dict | None],
             window_reviews: int, window_seconds: float) -> dict:
    """The monitoring endpoint's answer for one version: `by_worker` holds each worker's
    `VersionMonitor.counts()` of it (None where that worker does not serve it now)."""
    out: dict = {"version": str(version), "monitoring": state}
    if baseline is None:
        return out
    present = {worker: counts for worker, counts in sorted(by_worker.items()) if counts is not None}
    report = Report(baseline, list(present.values())) if present else None
    out["baseline"] = {"source": baseline.source, "reviews": baseline.reviews, "label_prior": baseline.label_prior,
                       "low_confidence_share": baseline.low_confidence_share, "low_confidence_below": LOW_CONFIDENCE,
                       "unlike_training_share": baseline.unlike_share, "unlike_training": baseline.unlike_bounds,
                       "edges": {name: list(baseline.edges[name]) for name in STATISTICS}}
    if report is None:
        return out
    out["reviews_total"] = report.reviews("total")
    out["windows"] = {"reviews": report.window("reviews", size=window_reviews * len(present)),
                      "seconds": report.window("seconds", seconds=window_seconds)}
    out["workers"] = []
    for worker, counts in present.items():
        own = Report(baseline, [counts])
        out["workers"].append({"worker": worker, **{
            window: {"reviews": own.reviews(window), "verdict": own.window(window)["verdict"],
                     "psi": {name: round(value, 4) for name, value in own.psi(window).items()}}
            for window in WINDOWS}})
    return out


class DriftCollector:
    """Prometheus families of every monitored version of this worker, computed when scraped:
    per window the PSI of each statistic, the reviews in it, the shares of reviews unlike training
    and of low-confidence answers (left out while a window holds fewer than MIN_REVIEWS reviews,
    so an alert never fires on a handful); and, since the version went live, a histogram of each
    statistic over the baseline's bins."""

    def __init__(self, monitors: Callable[[], list[tuple[str, int, VersionMonitor]]]) -> None:
        self._monitors = monitors

    def collect(self) -> list:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        window_labels = ["model", "version", "window"]
        psi = GaugeMetricFamily("serve_drift_psi", "Population stability index of a statistic of the reviews "
                                "in a window against the export's held-out reviews (above 0.25: shifted).",
                                labels=[*window_labels, "statistic"])
        reviews = GaugeMetricFamily("serve_drift_window_reviews", "Reviews in a drift window.", labels=window_labels)
        unlike = GaugeMetricFamily("serve_drift_unlike_training_ratio", "Share of a window's reviews unlike the "
                                   "held-out reviews (length or unknown n-grams outside their 1-99% range).",
                                   labels=window_labels)
        low = GaugeMetricFamily("serve_low_confidence_ratio", f"Share of a window's answers whose larger class "
                                f"probability is below {LOW_CONFIDENCE}.", labels=window_labels)
        base_unlike = GaugeMetricFamily("serve_drift_baseline_unlike_training_ratio", "The same share among the "
                                        "held-out reviews.", labels=["model", "version"])
        base_low = GaugeMetricFamily("serve_drift_baseline_low_confidence_ratio", "The share of low-confidence "
                                     "answers among the held-out reviews.", labels=["model", "version"])
        total = CounterMetricFamily("serve_monitored_reviews", "Reviews answered through drift monitoring.",
                                    labels=["model", "version"])
        histograms = {name: HistogramMetricFamily(f"serve_review_{name}", f"Served reviews: {DESCRIPTIONS[name]}.",
                                                  labels=["model", "version"]) for name in _SUMMED}
        for model, version, monitor in self._monitors():
            report, v = Report(monitor.baseline, [monitor.counts()]), str(version)
            base_unlike.add_metric([model, v], monitor.baseline.unlike_share)
            base_low.add_metric([model, v], monitor.baseline.low_confidence_share)
            total.add_metric([model, v], report.reviews("total"))
            for window in WINDOWS:
                count = report.reviews(window)
                reviews.add_metric([model, v, window], count)
                if count < MIN_REVIEWS:
                    continue
                for name, value in report.psi(window).items():
                    psi.add_metric([model, v, window, name], value)
                unlike.add_metric([model, v, window], report.share(window, "unlike_training"))
                low.add_metric([model, v, window], report.share(window, "low_confidence"))
            for name, family in histograms.items():
                cumulative = np.cumsum(report.of("total", name))
                buckets = [(_le(edge), int(c)) for edge, c in zip(monitor.baseline.edges[name], cumulative)]
                family.add_metric([model, v], [*buckets, ("+Inf", int(cumulative[-1]))], report.sums[name])
        return [psi, reviews, unlike, low, base_unlike, base_low, total, *histograms.values()]


def _le(edge: float) -> str:
    return repr(float(edge))
