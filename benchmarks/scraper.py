"""A Prometheus stand-in for the benchmarks: ``GET /metrics`` every INTERVAL seconds, each
answer parsed with Prometheus's own text parser, until SIGTERM; then one JSON line with how
many scrapes answered and how many failed.

    python -m benchmarks.scraper PORT INTERVAL_S
"""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request
from types import FrameType

from prometheus_client.parser import text_string_to_metric_families


def main() -> None:
    port, interval_s = int(sys.argv[1]), float(sys.argv[2])
    counts = {"scrapes": 0, "failed": 0, "families": 0}

    def report(signum: int, frame: FrameType | None) -> None:
        print(json.dumps(counts), flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, report)
    url = f"http://127.0.0.1:{port}/metrics"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                families = list(text_string_to_metric_families(answer.read().decode()))
            counts["scrapes"] += 1
            counts["families"] = len(families)
        except (OSError, ValueError):
            counts["failed"] += 1
        time.sleep(interval_s)


if __name__ == "__main__":
    main()
