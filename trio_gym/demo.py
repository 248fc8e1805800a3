"""``trio-gym demo``: a host with the example environment, a batch through the trainer client.

Everything is real: the host listens on a loopback port, the client speaks HTTP to it, the
answer streams back chunked with heartbeats. Only the distance is short.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

import trio

from trio_gym.config import ServeConfig
from trio_gym.host import Host, serve
from trio_gym.trainer import ClientSettings, RolloutClient, RolloutError

CHUNK_SIZE = 6
IN_FLIGHT = 2
THINK_S = 0.2
HEARTBEAT_S = 0.5


class DemoProgress:
    """One line per event on stderr, stamped with seconds since the start."""

    def __init__(self, chunks: int, out: TextIO) -> None:
        self.chunks = chunks
        self.out = out
        self.started = trio.current_time()
        self.done = 0
        self.heartbeats = 0

    def _say(self, text: str) -> None:
        print(f"  [{trio.current_time() - self.started:5.1f}s] {text}", file=self.out, flush=True)

    def chunk_started(self, chunk: int, attempt: int, size: int) -> None:
        retry = f" (attempt {attempt})" if attempt > 1 else ""
        self._say(f"chunk {chunk + 1}/{self.chunks}: sent {size} examples{retry}")

    def heartbeat(self, chunk: int) -> None:
        self.heartbeats += 1
        self._say(f"chunk {chunk + 1}/{self.chunks}: heartbeat (host still working)")

    def chunk_finished(self, chunk: int, results: Sequence[Any]) -> None:
        self.done += 1
        mean = sum(result["reward"] for result in results) / len(results)
        self._say(
            f"chunk {chunk + 1}/{self.chunks}: {len(results)} results, mean reward {mean:.2f} "
            f"({self.done}/{self.chunks} chunks done)"
        )

    def chunk_failed(self, chunk: int, error: RolloutError) -> None:
        self._say(f"chunk {chunk + 1}/{self.chunks}: FAILED {error}")


def demo_examples(count: int) -> list[dict[str, Any]]:
    return [
        {
            "seed": seed,
            "meetings": 3 + seed % 4,
            "think_s": THINK_S,
            "_ng_task_index": seed,
            "_ng_rollout_index": 0,
        }
        for seed in range(count)
    ]


async def run_demo(count: int, out: TextIO = sys.stderr) -> int:
    """Run the demo; return the process exit status."""
    config = ServeConfig(port=0, heartbeat_interval_s=HEARTBEAT_S, job_id="demo")
    host = Host(config)
    examples = demo_examples(count)
    chunks = -(-count // CHUNK_SIZE)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, host)
        await host.lifecycle.settled.wait()
        url = f"http://127.0.0.1:{port}"
        print(
            f"trio-gym demo: host at {url} running the example calendar environment\n"
            f"  {count} episodes in {chunks} chunk(s) of up to {CHUNK_SIZE}, {IN_FLIGHT} in "
            f"flight, heartbeat every {HEARTBEAT_S} s",
            file=out,
        )
        progress = DemoProgress(chunks, out)
        client = RolloutClient(
            url, ClientSettings(chunk_size=CHUNK_SIZE, max_in_flight=IN_FLIGHT), progress=progress
        )
        try:
            results = await client.run(examples)
        except RolloutError as exc:
            print(f"trio-gym demo: the batch failed: {exc}", file=out)
            return 1
        finally:
            host.lifecycle.request_shutdown()
        elapsed = trio.current_time() - progress.started
    print_summary(examples, results, elapsed, progress.heartbeats, sys.stdout)
    return 0


def print_summary(
    examples: Sequence[dict[str, Any]],
    results: Sequence[dict[str, Any]],
    elapsed_s: float,
    heartbeats: int,
    out: TextIO,
) -> None:
    rewards = [result["reward"] for result in results]
    perfect = sum(1 for reward in rewards if reward == 1.0)
    print("\nSummary", file=out)
    print(f"  episodes        {len(results)}", file=out)
    print(f"  mean reward     {sum(rewards) / len(rewards):.3f}", file=out)
    print(f"  perfect (1.0)   {perfect} of {len(results)}", file=out)
    print(f"  steps taken     {sum(result['steps'] for result in results)}", file=out)
    print(f"  heartbeats      {heartbeats}", file=out)
    print(f"  wall time       {elapsed_s:.1f} s", file=out)
    print("\n  task  seed  requests  booked  skipped                    reward", file=out)
    for example, result in zip(examples, results, strict=True):
        skipped = ", ".join(result["skipped"]) or "-"
        if len(skipped) > 25:
            skipped = skipped[:22] + "..."
        print(
            f"  {result['_ng_task_index']:>4}  {example['seed']:>4}  {example['meetings']:>8}  "
            f"{len(result['booked']):>6}  {skipped:<25}  {result['reward']:.2f}",
            file=out,
        )
