"""``trio-gym`` (also ``python -m trio_gym``): argument parsing and nothing else of substance.

Every subcommand is a thin front over the library: ``serve`` over :func:`trio_gym.host.serve`,
``demo`` over the host and :class:`trio_gym.trainer.RolloutClient`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from trio_gym import logs
from trio_gym.config import ConfigError, load_serve_config
from trio_gym.demo import run_demo
from trio_gym.host import Host, serve

# serve's flags and the config fields they set (DESIGN §7).
SERVE_FLAGS: dict[str, tuple[str, type, str]] = {
    "--host": ("host", str, "address to bind (default 127.0.0.1)"),
    "--port": ("port", int, "TCP port, 0 for any free one (default 8080)"),
    "--runner": ("runner", str, "'example' or package.module:factory (default example)"),
    "--heartbeat-interval": ("heartbeat_interval_s", float, "seconds between heartbeats (15)"),
    "--deadline": ("rollout_deadline_s", float, "longest a batch may run, seconds (1800)"),
    "--max-request-bytes": ("max_request_bytes", int, "largest request body (256 MiB)"),
    "--max-response-bytes": ("max_response_bytes", int, "largest results document (256 MiB)"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-gym", description="Host RL environments in sandboxes, and talk to them."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve_cmd = commands.add_parser(
        "serve",
        help="run the host",
        description="Run the host. Flags override NMP_* environment variables, which override "
        "the config file, which overrides the defaults.",
    )
    serve_cmd.add_argument("--config", type=Path, help="YAML or JSON serve config")
    for flag, (field, kind, text) in SERVE_FLAGS.items():
        serve_cmd.add_argument(flag, dest=field, type=kind, help=text)

    demo_cmd = commands.add_parser(
        "demo", help="run a batch through an in-process host and show the results"
    )
    demo_cmd.add_argument("--examples", type=int, default=24, help="how many episodes (24)")
    demo_cmd.add_argument("--verbose", action="store_true", help="also print the JSON logs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return _demo(args)


def _serve(args: argparse.Namespace) -> int:
    logs.configure()
    flags: dict[str, Any] = {field: getattr(args, field) for field, _, _ in SERVE_FLAGS.values()}
    try:
        names = {field: flag for flag, (field, _, _) in SERVE_FLAGS.items()}
        config = load_serve_config(file=args.config, flags=flags, flag_names=names)
    except ConfigError as exc:
        print(f"trio-gym serve: {exc}", file=sys.stderr)
        return 2
    trio.run(_serve_until_signalled, Host(config))
    return 0


async def _serve_until_signalled(host: Host) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, host, nursery.cancel_scope)
        await serve(host)
        nursery.cancel_scope.cancel()


async def _stop_on_signals(host: Host, scope: trio.CancelScope) -> None:
    """First SIGINT/SIGTERM: graceful shutdown. A second one: stop now."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            if host.shutdown_requested.is_set():
                scope.cancel()
                return
            host.request_shutdown()


def _demo(args: argparse.Namespace) -> int:
    logs.configure(level=logging.INFO if args.verbose else logging.WARNING)
    if args.examples < 1:
        print("trio-gym demo: --examples must be at least 1", file=sys.stderr)
        return 2
    return trio.run(run_demo, args.examples)


if __name__ == "__main__":
    sys.exit(main())
