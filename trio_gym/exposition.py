"""What the host's and the trainer's metrics share: a histogram kept as plain counts, and the
Prometheus families made from such counts when someone scrapes (``prometheus_client``, the
``metrics`` extra, writes the text; it is imported only then)."""

from __future__ import annotations

import bisect
import typing
from collections.abc import Iterable, Iterator
from typing import Final, Protocol

import attrs

if typing.TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

PREFIX: Final = "trio_gym_"
EXTRA_ADVICE: Final = "install trio-gym's metrics extra: pip install 'trio-gym[metrics]'"


class MetricsUnavailable(Exception):
    """``prometheus_client`` is not installed; the message says how to get it."""


@attrs.define
class Histogram:
    """Counts per bucket (``bounds`` are the upper bounds, inclusive, as Prometheus's ``le``),
    and the sum; cumulated only when exposed."""

    bounds: tuple[float, ...]
    counts: list[int] = attrs.field()
    total: float = 0.0

    @counts.default
    def _no_counts(self) -> list[int]:
        return [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)


class Collector(Protocol):
    def collect(self) -> Iterator[Metric]: ...


def render(collector: Collector) -> tuple[bytes, str]:
    """The exposition of ``collector`` and its media type; raises :class:`MetricsUnavailable`."""
    try:
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
    except ImportError as exc:
        raise MetricsUnavailable(f"metrics need prometheus_client: {EXTRA_ADVICE}") from exc
    return generate_latest(collector), CONTENT_TYPE_LATEST


def gauge(name: str, documentation: str, value: float) -> Metric:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(f"{PREFIX}{name}", documentation, value=value)


def counter(name: str, documentation: str, value: float) -> Metric:
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(f"{PREFIX}{name}", documentation, value=value)


def counters_by(
    name: str,
    documentation: str,
    labels: list[str],
    counts: Iterable[tuple[tuple[str, ...], float]],
    *,
    always: Iterable[tuple[str, ...]] = (),
) -> Metric:
    """A counter family with a series per label values; ``always`` appear at 0 before their
    first event, so a rate over them is defined from the start."""
    from prometheus_client.core import CounterMetricFamily

    return _by(CounterMetricFamily(f"{PREFIX}{name}", documentation, labels=labels), counts, always)


def gauges_by(
    name: str,
    documentation: str,
    labels: list[str],
    values: Iterable[tuple[tuple[str, ...], float]],
    *,
    always: Iterable[tuple[str, ...]] = (),
) -> Metric:
    from prometheus_client.core import GaugeMetricFamily

    return _by(GaugeMetricFamily(f"{PREFIX}{name}", documentation, labels=labels), values, always)


def one_of(
    name: str, documentation: str, label: str, values: Iterable[str], current: str
) -> Metric:
    """A gauge per possible value, 1 for the current one (Prometheus's state-set, as a gauge)."""
    return gauges_by(
        name, documentation, [label], (((value,), int(value == current)) for value in values)
    )


def histograms(
    name: str,
    documentation: str,
    series: dict[tuple[str, ...], Histogram],
    *,
    labels: list[str] | None = None,
) -> Metric:
    from prometheus_client.core import HistogramMetricFamily

    metric = HistogramMetricFamily(f"{PREFIX}{name}", documentation, labels=labels or [])
    for values, histogram in sorted(series.items()):
        cumulative, buckets = 0, []
        for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        metric.add_metric(list(values), buckets, histogram.total)
    return metric


def _by(
    metric: typing.Any,
    counts: Iterable[tuple[tuple[str, ...], float]],
    always: Iterable[tuple[str, ...]],
) -> Metric:
    values = dict.fromkeys(always, 0.0) | dict(counts)
    for labels, count in sorted(values.items()):
        metric.add_metric(list(labels), count)
    return typing.cast("Metric", metric)
