"""Reading a host's ``/metrics`` in tests, as ``trio-gym status`` reads it: through Prometheus's own
text parser (``trio_gym.trainer.status.parse_metrics``)."""

from __future__ import annotations

from tests.helpers import request_bytes, tcp_exchange
from trio_gym.trainer.status import Samples
from trio_gym.trainer.status import parse_metrics as parse

__all__ = ["Samples", "parse", "scrape", "value"]


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def scrape(port: int) -> Samples:
    reply = await tcp_exchange(port, request_bytes(method="GET", target="/metrics"), method=b"GET")
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"].startswith("text/plain")
    return parse(reply.body.decode())
