"""Reading a host's ``/metrics`` in tests: through Prometheus's own text parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import request_bytes, tcp_exchange

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by name and labels, through Prometheus's parser."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def scrape(port: int) -> Samples:
    reply = await tcp_exchange(port, request_bytes(method="GET", target="/metrics"), method=b"GET")
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"].startswith("text/plain")
    return parse(reply.body.decode())
