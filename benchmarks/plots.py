"""The figures of BENCHMARKS.md, drawn from a results file as PNGs beside it.

    python -m benchmarks.plots [benchmarks/results.json]    # needs the bench extra (matplotlib)

- ``benchmarks-lateness.png``: how late heartbeats came, per server, with 10,000 held
  connections (the whole distribution, from each run's percentiles, median of the runs);
- ``benchmarks-rss.png``: what each held connection costs in memory, against how many are held;
- ``benchmarks-requests.png``: short batches per second per server, against the stack's floor
  (``benchmarks/peers/floor.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from benchmarks.run import FLOORS, ROOT, SERVERS

COLOURS = {
    "trio_gym": "tab:blue",
    "trio_gym_h11": "tab:purple",
    "threaded": "tab:orange",
    "uvicorn": "tab:green",
}
LABELS = {
    "trio_gym": "trio_gym",
    "trio_gym_h11": "trio_gym on pure h11",
    "threaded": "threaded (the design replaced)",
    "uvicorn": "uvicorn (uvloop + httptools)",
    "floor_bare": "floor: trio, canned answer",
    "floor_h11": "floor: trio + h11 + JSON",
    "floor_tasks": "floor: + nursery, heartbeat task, task per example",
}


def lateness(medians: dict[str, Any], out: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for kind in SERVERS:
        percentiles = medians.get("held-10000", {}).get(kind, {}).get("lateness_percentiles_ms")
        if percentiles:
            axes.plot(
                [max(value, 0.01) for value in percentiles],
                range(101),
                label=LABELS[kind],
                color=COLOURS[kind],
            )
    axes.set_xscale("log")
    axes.set_xlabel("heartbeat lateness (ms, log scale)")
    axes.set_ylabel("heartbeats at most this late (%)")
    axes.set_title("10,000 held connections, a heartbeat every second")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def rss(medians: dict[str, Any], out: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.2))
    sizes = sorted(int(name.split("-")[1]) for name in medians if name.startswith("held-"))
    for kind in SERVERS:
        points = [
            (size, medians[f"held-{size}"][kind]["rss_per_connection_kib"])
            for size in sizes
            if kind in medians[f"held-{size}"]
        ]
        if points:
            axes.plot(
                [size for size, _ in points],
                [size * kib / 1024 for size, kib in points],
                marker="o",
                label=f"{LABELS[kind]}: {points[-1][1]:.1f} KiB each at {points[-1][0]:,}",
                color=COLOURS[kind],
            )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes.xaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    axes.set_xlabel("held connections (log scale)")
    axes.set_ylabel("RSS they add (MiB, log scale)")
    axes.set_title("Memory of held connections")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def requests(medians: dict[str, Any], out: Path) -> None:
    short = medians.get("short", {})
    kinds = [kind for kind in SERVERS + FLOORS if kind in short]
    figure, axes = plt.subplots(figsize=(7, 4.2))
    values = [short[kind]["requests_per_s"] for kind in kinds]
    colours = [COLOURS.get(kind, "tab:gray") for kind in kinds]
    bars = axes.barh([LABELS[kind] for kind in kinds], values, color=colours)
    axes.bar_label(bars, labels=[f"{value:,.0f}" for value in values], padding=3)
    axes.invert_yaxis()
    axes.set_xlabel("short batches per second, server on one core")
    axes.set_title("One-example batches, a connection each (wrk, 64 at once)", fontsize=10)
    axes.set_xlim(0, max(values) * 1.18)
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def main() -> None:
    results = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "results.json"
    medians = json.loads(results.read_text())["medians"]
    lateness(medians, ROOT / "benchmarks-lateness.png")
    rss(medians, ROOT / "benchmarks-rss.png")
    requests(medians, ROOT / "benchmarks-requests.png")
    print("wrote", ", ".join(f"benchmarks-{n}.png" for n in ("lateness", "rss", "requests")))


if __name__ == "__main__":
    main()
