"""``trio-gym`` (also ``python -m trio_gym``): argument parsing and nothing else of substance.

Every subcommand is a thin front over the library: ``serve`` over :func:`trio_gym.host.serve`,
``demo`` over the host and :class:`trio_gym.trainer.RolloutClient`, ``run`` over the client, or
a pool of hosts (:mod:`trio_gym.fleet.spread`).
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Final, cast

import trio

from trio_gym import logs
from trio_gym.config import (
    FLAG_VALUES,
    SETTINGS,
    ConfigError,
    ServeConfig,
    default_text,
    load_caller_config,
    load_serve_config,
    parse_agent_pairs,
    read_config_file,
)
from trio_gym.demo import run_demo
from trio_gym.demo_fleet import run_fleet_demo
from trio_gym.errors import leaves
from trio_gym.exposition import MetricsUnavailable
from trio_gym.fleet.launch import HostSpec
from trio_gym.fleet.spread import Launch, batch_runner
from trio_gym.host import Host, ListenError, serve
from trio_gym.http import Endpoint
from trio_gym.install import InstallError, PackageError, install_environment, load_package
from trio_gym.trainer import ClientSettings
from trio_gym.trainer.batch_file import run_file
from trio_gym.trainer.hosts import read_identity
from trio_gym.trainer.metrics import FleetStats, serve_metrics
from trio_gym.trainer.scheduler import SchedulerSettings
from trio_gym.trainer.status import show_status


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
    _add_config_flags(serve_cmd, installer_only=False)

    install_cmd = commands.add_parser(
        "install",
        help="run only the installer stage",
        description="Validate the environment package and install it as serve would; exit 0 "
        "when the environment is ready, 1 otherwise.",
    )
    _add_config_flags(install_cmd, installer_only=True)

    validate_cmd = commands.add_parser(
        "validate",
        help="validate an environment package",
        description="Check an environment package without importing any of its code: print a "
        "summary (exit 0) or every problem, one per line (exit 1).",
    )
    validate_cmd.add_argument("path", type=Path, help="the package directory")

    run_cmd = commands.add_parser(
        "run",
        help="send a JSON-lines file of examples to a host",
        description="Send the examples (one JSON object per line) to a host with the trainer "
        "client; progress on stderr; the results as JSON lines, in input order. A failure "
        "exits 1 naming its cause (sandbox, proxy or client).",
    )
    run_cmd.add_argument("examples", type=Path, metavar="FILE.jsonl")
    run_cmd.add_argument(
        "--url",
        dest="urls",
        action="append",
        default=[],
        help="a host, e.g. http://127.0.0.1:8080; repeat it to spread the file over several",
    )
    run_cmd.add_argument(
        "--identity-file",
        type=Path,
        help="with --url: a file holding the identity the hosts were launched with "
        "(NMP_HOST_IDENTITY); such a host serves only callers that send it",
    )
    run_cmd.add_argument(
        "--launch",
        metavar="KIND:N",
        help="launch N hosts for this run and stop them after, e.g. local:4",
    )
    run_cmd.add_argument(
        "--host-config",
        type=Path,
        help="with --launch: a caller config (YAML) the launched hosts are started from",
    )
    run_cmd.add_argument(
        "--out",
        type=Path,
        help="write results here (default: stdout); failure records go to <stem>_failures.jsonl "
        "beside it",
    )
    run_cmd.add_argument("--chunk-size", type=int, default=8, help="examples per request (8)")
    run_cmd.add_argument(
        "--max-in-flight",
        type=int,
        default=8,
        help="requests at once (8); with several hosts, per host",
    )
    run_cmd.add_argument(
        "--max-attempts", type=int, default=3, help="tries per chunk, with one host (3)"
    )
    run_cmd.add_argument("--deadline", type=float, help="deadline_s sent with each request")
    run_cmd.add_argument(
        "--metrics-port",
        type=int,
        help="serve the run's own metrics (hosts by state, chunks, ejections, replacements) "
        "as Prometheus text at http://HOST:PORT/metrics while it runs (0: any free port, said "
        "on stderr)",
    )
    run_cmd.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="the address --metrics-port listens on (127.0.0.1; 0.0.0.0 for every interface)",
    )
    defaults = ClientSettings()
    run_cmd.add_argument(
        "--idle-timeout",
        type=float,
        default=defaults.idle_timeout_s,
        help=f"the longest silence in an answer, in s ({defaults.idle_timeout_s:g}; heartbeats "
        "come every 15 s)",
    )
    run_cmd.add_argument(
        "--head-timeout",
        type=float,
        default=defaults.head_timeout_s,
        help=f"how long an answer's head may take once a request is sent, in s "
        f"({defaults.head_timeout_s:g}; a host sends it on admitting the batch)",
    )
    run_cmd.add_argument(
        "--request-deadline",
        type=float,
        default=defaults.request_deadline_s,
        help=f"the longest a request may take in all, in s ({defaults.request_deadline_s:g})",
    )
    run_cmd.add_argument(
        "--http10", action="store_true", help="speak HTTP/1.0 (buffered answers, no heartbeats)"
    )

    status_cmd = commands.add_parser(
        "status",
        help="watch hosts: one line each from /health and /metrics",
        description="One line per host: its health, stage, batches and examples in flight, "
        "examples per second, heartbeat lateness and failures by class. On a terminal it "
        "refreshes in place until Ctrl-C; otherwise (or with --once) it prints once, from two "
        "reads --interval apart, and exits 0 when every host is ready, 1 otherwise.",
    )
    status_cmd.add_argument("urls", nargs="+", metavar="URL", help="a host, e.g. http://h:8080")
    status_cmd.add_argument("--interval", type=float, default=2.0, help="seconds between reads (2)")
    status_cmd.add_argument("--once", action="store_true", help="print once, even on a terminal")
    status_cmd.add_argument(
        "--identity-file",
        type=Path,
        help="a file holding the identity the hosts were launched with (NMP_HOST_IDENTITY): "
        "such a host tells anyone without it only whether it is ready",
    )

    demo_cmd = commands.add_parser(
        "demo",
        help="run a batch through an in-process host and show the results",
        description="Start a host with the example environment on a loopback port, run a batch "
        "through the trainer client with progress on stderr, and print a summary.",
    )
    demo_cmd.add_argument("--examples", type=int, default=24, help="how many episodes (24)")
    demo_cmd.add_argument(
        "--fleet",
        action="store_true",
        help="four host processes, a checkpoint mid-flight, one host killed and replaced: "
        "every episode consumed exactly once",
    )
    demo_cmd.add_argument("--verbose", action="store_true", help="also print the JSON logs")
    return parser


def _add_config_flags(parser: argparse.ArgumentParser, *, installer_only: bool) -> None:
    """The config's flags (``install`` takes the installer stage's alone), made from the
    fields' :class:`~trio_gym.config.Setting`."""
    parser.add_argument("--config", type=Path, help="YAML or JSON serve config")
    flag_table: dict[str, str] = {}
    for name, setting in SETTINGS.items():
        if not setting.flag or (installer_only and not setting.installer):
            continue
        field = ServeConfig.model_fields[name]
        text = f"{field.description} Default: {default_text(name).strip('`')}."
        if field.annotation is bool:
            parser.add_argument(
                setting.flag, dest=name, action="store_const", const=True, help=text
            )
        elif name in FLAG_VALUES:  # a mapping, one pair per flag
            metavar = FLAG_VALUES[name]
            parser.add_argument(
                setting.flag, dest=name, action="append", metavar=metavar, help=text
            )
        else:
            kind = cast("Callable[[str], Any]", field.annotation)  # str, int or float
            parser.add_argument(setting.flag, dest=name, type=kind, help=text)
        flag_table[name] = setting.flag
    parser.set_defaults(flag_table=flag_table)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "install":
        return _install(args)
    if args.command == "validate":
        return _validate(args)
    if args.command == "run":
        return _run(args)
    if args.command == "status":
        return _status(args)
    return _demo(args)


def _status(args: argparse.Namespace) -> int:
    logs.configure(level=logging.ERROR)
    try:
        for url in args.urls:
            Endpoint.parse(url)
    except ValueError as exc:
        print(f"trio-gym status: {exc}", file=sys.stderr)
        return 2
    try:
        identity = "" if args.identity_file is None else read_identity(args.identity_file)
    except ValueError as exc:
        print(f"trio-gym status: {exc}", file=sys.stderr)
        return 2
    live = sys.stdout.isatty() and not args.once
    show = partial(show_status, args.urls, interval_s=args.interval, live=live, identity=identity)
    try:
        return trio.run(show)
    except MetricsUnavailable as exc:
        print(f"trio-gym status: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def _config(args: argparse.Namespace) -> ServeConfig | None:
    """The serve config from file, environment and this command's flags; None after an error."""
    names: dict[str, str] = dict(args.flag_table)
    flags = {name: getattr(args, name) for name in names}
    if flags.get("agents"):
        try:
            flags["agents"] = parse_agent_pairs(flags["agents"])
        except ValueError as exc:
            print(f"trio-gym {args.command}: {names['agents']} {exc}", file=sys.stderr)
            return None
    if flags.get("environment_path") is not None:
        # A package named on the command line is meant to be there: missing is an error.
        flags["environment_package_required"] = True
        names["environment_package_required"] = "--environment-path"
    try:
        return load_serve_config(file=args.config, flags=flags, flag_names=names)
    except ConfigError as exc:
        print(f"trio-gym {args.command}: {exc}", file=sys.stderr)
        return None


def _serve(args: argparse.Namespace) -> int:
    logs.configure()
    config = _config(args)
    if config is None:
        return 2
    failure: ListenError | None = None
    _collect_garbage_in_bulk()
    try:
        trio.run(_serve_until_signalled, Host(config))
    except* ListenError as group:
        failure = leaves(group)[0]
    if failure is not None:
        print(f"trio-gym serve: {failure}", file=sys.stderr)
        return 2
    return 0


def _install(args: argparse.Namespace) -> int:
    logs.configure()
    config = _config(args)
    if config is None:
        return 2
    try:
        package = trio.run(install_environment, config)
    except InstallError as exc:
        print(f"trio-gym install: {exc}", file=sys.stderr)
        return 1
    print(package.summary() if package else "no environment package: nothing to install")
    return 0


def _validate(args: argparse.Namespace) -> int:
    try:
        package = load_package(args.path)
    except PackageError as exc:
        print(f"{exc.root}: {len(exc.problems)} problem(s)")
        for problem in exc.problems:
            print(f"  {problem}")
        return 1
    print(package.summary())
    return 0


# Young-generation collections every this many allocations (CPython's default is 700; 10,000
# measured worse than 50,000, see BENCHMARKS.md).
GC_YOUNG_THRESHOLD: Final = 50_000


def _collect_garbage_in_bulk() -> None:
    """Collect cyclic garbage in fewer, larger rounds, and never look at startup objects again.

    With the default thresholds a host holding ten thousand heartbeating connections collects
    the young generation hundreds of times a second; everything that lives for one heartbeat
    interval survives into the old generation, whose full collections then walk every live
    connection's objects — pauses of over a second, measured as heartbeat lateness
    (BENCHMARKS.md). Rarer young collections let per-heartbeat objects die young; freezing
    what exists at startup (modules, configuration) keeps it out of every collection.
    """
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 100)
    gc.freeze()


async def _serve_until_signalled(host: Host) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, host, nursery.cancel_scope)
        await serve(host)
        nursery.cancel_scope.cancel()


async def _stop_on_signals(host: Host, scope: trio.CancelScope) -> None:
    """First SIGINT/SIGTERM: graceful shutdown. A second one: stop now."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            if host.lifecycle.shutdown_requested.is_set():
                scope.cancel()
                return
            host.lifecycle.request_shutdown()


def _run(args: argparse.Namespace) -> int:
    logs.configure(level=logging.WARNING)
    stats = FleetStats()
    try:
        settings = ClientSettings(
            chunk_size=args.chunk_size,
            max_in_flight=args.max_in_flight,
            max_attempts=args.max_attempts,
            host_deadline_s=args.deadline,
            idle_timeout_s=args.idle_timeout,
            head_timeout_s=args.head_timeout,
            request_deadline_s=args.request_deadline,
            http_version="1.0" if args.http10 else "1.1",
            failures="records",  # a failed example costs no other its result
        )
        identity = "" if args.identity_file is None else read_identity(args.identity_file)
        run_batch = batch_runner(
            urls=args.urls,
            identity=identity,
            launch=None if args.launch is None else Launch.parse(args.launch),
            spec=_launched_host_spec(args.host_config),
            client_settings=settings,
            pool_settings=SchedulerSettings(per_host_in_flight=args.max_in_flight),
            stats=stats,
        )
    except (ValueError, ConfigError) as exc:
        print(f"trio-gym run: {exc}", file=sys.stderr)
        return 2
    run = partial(run_file, args.examples, args.out, args.chunk_size, run_batch)
    if args.metrics_port is None:
        return trio.run(run)
    return trio.run(_run_exporting, run, stats, args.metrics_host, args.metrics_port)


async def _run_exporting(
    run: Callable[[], Awaitable[int]], stats: FleetStats, host: str, port: int
) -> int:
    """``run`` beside the exporter of its metrics, which ends with it."""
    async with trio.open_nursery() as nursery:
        try:
            bound = await nursery.start(partial(serve_metrics, stats, port, host=host))
        except (OSError, MetricsUnavailable) as exc:
            print(f"trio-gym run: cannot serve --metrics-port {port}: {exc}", file=sys.stderr)
            return 2
        print(f"trio-gym run: metrics at http://{host}:{bound}/metrics", file=sys.stderr)
        code = await run()
        nursery.cancel_scope.cancel()
    return code


def _launched_host_spec(host_config: Path | None) -> HostSpec:
    if host_config is None:
        return HostSpec()
    data = read_config_file(host_config)
    return HostSpec.from_caller(load_caller_config(data, source=str(host_config)))


def _demo(args: argparse.Namespace) -> int:
    quiet = logging.ERROR if args.fleet else logging.WARNING  # the fleet's losses are the show
    logs.configure(level=logging.INFO if args.verbose else quiet)
    if args.examples < 1:
        print("trio-gym demo: --examples must be at least 1", file=sys.stderr)
        return 2
    return trio.run(run_fleet_demo if args.fleet else run_demo, args.examples)


if __name__ == "__main__":
    sys.exit(main())
