"""The ``runstate`` command: run a worker, look at a run, cancel a run.

    runstate worker pkg.module:handler --mailbox reviews [--scope RUN_ID] [--concurrency N] [--queue]
    runstate status RUN_ID [--json]
    runstate cancel RUN_ID [--reason TEXT]

The server and key come from ``RUNSTATE_URL`` and ``RUNSTATE_API_KEY`` (or ``--url`` and
``--api-key``), the run of ``worker`` from ``--scope`` or ``RUNSTATE_SCOPE_ID``. Exit status:
0 done, 1 the service refused (printed as ``CODE: message``), 2 a configuration error (bad
handler path, no run, no key). Without ``RUNSTATE_URL`` it talks to ``http://127.0.0.1:8000``,
as the clients do.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from runstate._async.client import AsyncRunstate
from runstate._config import DEFAULT_URL, JsonDict
from runstate._errors import RunstateError
from runstate._sync.client import Runstate
from runstate._tracing import configure as configure_tracing
from runstate._worker import is_async_callable

logger = logging.getLogger("runstate.cli")

EXIT_REFUSED = 1
EXIT_CONFIG = 2


class ConfigError(Exception):
    """A problem with the command line or the environment (exit status 2)."""


def load_handler(path: str) -> Callable[..., Any]:
    """Import ``pkg.module:attr`` (``attr`` may be dotted) and return it; ``ConfigError`` if it is not a callable."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"handler {path!r} is not of the form 'pkg.module:function'")
    # Like ``python -m`` and celery, a handler module next to where the command runs is importable.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name) and module_name[len(exc.name) :][:1] in ("", "."):
            raise ConfigError(f"handler {path!r}: no module named {exc.name!r}") from exc
        raise  # the module exists but one of its own imports is missing: show the real traceback
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"handler {path!r}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(target):
        raise ConfigError(f"handler {path!r} is not callable (it is a {type(target).__name__})")
    handler: Callable[..., Any] = target
    return handler


def _client_options(args: argparse.Namespace) -> tuple[str, str]:
    # The same default as the clients' (ClientConfig): the local development server.
    url = args.url or os.environ.get("RUNSTATE_URL") or DEFAULT_URL
    key = args.api_key or os.environ.get("RUNSTATE_API_KEY")
    if not key:
        raise ConfigError("no API key: set RUNSTATE_API_KEY or pass --api-key")
    return url, key


# worker ---------------------------------------------------------------------------------


def _stop_on_sigint(stop: Callable[[], None]) -> None:
    """Make Ctrl-C stop the worker as SIGTERM does (drain, then release), a second one exits at once."""
    if threading.current_thread() is threading.main_thread():

        def handler(signum: int, frame: object) -> None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            logger.info("SIGINT: stopping (again to exit at once)")
            stop()

        signal.signal(signal.SIGINT, handler)


def cmd_worker(args: argparse.Namespace) -> int:
    """Run the worker loop until the run refuses work or SIGTERM / SIGINT; 0 on a normal stop."""
    handler = load_handler(args.handler)
    scope_id = args.scope or os.environ.get("RUNSTATE_SCOPE_ID")
    if not scope_id:
        raise ConfigError("no run: pass --scope RUN_ID or set RUNSTATE_SCOPE_ID")
    if args.concurrency < 1:
        raise ConfigError("--concurrency must be >= 1")
    if args.grace_s < 0:
        raise ConfigError("--grace-s must be >= 0")
    options = _client_options(args)
    configure_tracing("runstate-worker")
    kind = "queue" if args.queue else "work"
    logger.info(
        "worker %s on run %s, %s mailbox %r, concurrency %d (pid %d)",
        args.handler,
        scope_id,
        kind,
        args.mailbox,
        args.concurrency,
        os.getpid(),
    )
    if args.queue:
        summary = _run_queue(handler, scope_id, args, options)
    elif is_async_callable(handler):
        summary = asyncio.run(_run_async(handler, scope_id, args, options))
    else:
        # A plain function gets the sync client's context (``ctx.signal`` is a ``threading.Event``).
        with Runstate(*options) as rs:
            worker = rs.scope(scope_id).worker(
                args.mailbox,
                handler,
                concurrency=args.concurrency,
                lease_ttl_ms=args.lease_ttl_ms,
                drain_timeout=args.grace_s,
            )
            _stop_on_sigint(worker.stop)
            summary = worker.run()
    logger.info("worker stopped: %s", summary)
    return 0


async def _run_async(handler: Any, scope_id: str, args: argparse.Namespace, options: tuple[str, str]) -> Any:
    async with AsyncRunstate(*options) as rs:
        worker = rs.scope(scope_id).worker(
            args.mailbox,
            handler,
            concurrency=args.concurrency,
            lease_ttl_ms=args.lease_ttl_ms,
            drain_timeout=args.grace_s,
        )
        _stop_on_sigint(worker.stop)
        return await worker.run()


def _run_queue(handler: Any, scope_id: str, args: argparse.Namespace, options: tuple[str, str]) -> Any:
    """Run the message loop of a QUEUE mailbox (``consume_messages``), stopped as the task loop is."""
    if is_async_callable(handler):

        async def main() -> Any:
            async with AsyncRunstate(*options) as rs:
                worker = rs.scope(scope_id).message_worker(
                    args.mailbox, handler, concurrency=args.concurrency, drain_timeout=args.grace_s
                )
                _stop_on_sigint(worker.stop)
                return await worker.run()

        return asyncio.run(main())
    with Runstate(*options) as rs:
        worker = rs.scope(scope_id).message_worker(
            args.mailbox, handler, concurrency=args.concurrency, drain_timeout=args.grace_s
        )
        _stop_on_sigint(worker.stop)
        return worker.run()


# status / cancel ------------------------------------------------------------------------


def _all_pages(fetch: Callable[[str | None], JsonDict], key: str = "results") -> list[JsonDict]:
    items: list[JsonDict] = []
    cursor: str | None = None
    while True:
        page = fetch(cursor)
        items.extend(page[key])
        cursor = page.get("nextCursor")
        if not cursor or not page[key]:
            return items


def _run_tree(rs: Runstate, run: JsonDict, limit: int) -> JsonDict:
    """Return the run with its ``groups`` and ``children`` (child runs, ``limit`` levels deep).

    There is no list of groups: they are found through the ``group.created`` events under the
    run (one pass for the whole tree). A group's gate run is shown as the group, not as a child.
    """
    events = _all_pages(lambda cursor: _group_events(rs, run["id"], cursor), key="events")
    groups: dict[str, list[JsonDict]] = {}
    for event in events:
        group = rs.groups.by_id(event["subjectId"]).status()
        groups.setdefault(str(group.get("parentScopeId")), []).append(group)
    gates = {str(group.get("scopeId")) for found in groups.values() for group in found}
    return _subtree(rs, run, groups, gates, 0, limit)


def _subtree(
    rs: Runstate, run: JsonDict, groups: dict[str, list[JsonDict]], gates: set[str], depth: int, limit: int
) -> JsonDict:
    node = dict(run)
    node["groups"] = groups.get(str(run["id"]), [])
    node["children"] = []
    if depth >= limit:
        return node
    children = _all_pages(lambda cursor: rs.scopes.list(parent_id=run["id"], cursor=cursor, limit=1000))
    node["children"] = [
        _subtree(rs, child, groups, gates, depth + 1, limit) for child in children if str(child["id"]) not in gates
    ]
    return node


def _group_events(rs: Runstate, run_id: str, cursor: str | None) -> JsonDict:
    page: JsonDict = rs.events.list(run_id=run_id, types=["group.created"], after=cursor, limit=1000)
    return page


def _state_of(run: JsonDict) -> str:
    state = str(run.get("storedState"))
    if run.get("effective") == "INACTIVE" and run.get("inactiveReason") and state == "ACTIVE":
        state = f"INACTIVE ({run['inactiveReason']} by {run.get('inactiveRunId')})"
    if run.get("cancelReason"):
        state += f" reason={run['cancelReason']!r}"
    return state


def _print_tree(node: JsonDict, prefix: str = "", last: bool = True, root: bool = True) -> None:
    branch = "" if root else ("└─ " if last else "├─ ")
    name = f" {node['name']!r}" if node.get("name") else ""
    print(f"{prefix}{branch}run {node['id']}{name}  {_state_of(node)}")
    inner = prefix + ("" if root else ("   " if last else "│  "))
    items: list[tuple[str, JsonDict]] = [("group", g) for g in node.get("groups", [])]
    items += [("run", c) for c in node.get("children", [])]
    for index, (kind, item) in enumerate(items):
        is_last = index == len(items) - 1
        if kind == "run":
            _print_tree(item, inner, is_last, root=False)
            continue
        members = item.get("members", [])
        done = sum(1 for m in members if m.get("state") in ("SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"))
        outcome = f" outcome={item['outcome']}" if item.get("outcome") else ""
        print(
            f"{inner}{'└─ ' if is_last else '├─ '}group {item['id']} {item.get('condition')} "
            f"{item.get('state')}{outcome}  members {done}/{len(members)} finished"
        )


def cmd_status(args: argparse.Namespace) -> int:
    """Print the run with its child runs and groups (a tree, or JSON with ``--json``)."""
    with Runstate(*_client_options(args)) as rs:
        run = rs.scope(args.run_id).status()
        tree = _run_tree(rs, run, args.depth)
    if args.json:
        print(json.dumps(tree, indent=2))
    else:
        _print_tree(tree)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel the run and print its state."""
    with Runstate(*_client_options(args)) as rs:
        run = rs.scope(args.run_id).cancel(reason=args.reason)
    print(f"run {run['id']}  {_state_of(run)}")
    return 0


# main -----------------------------------------------------------------------------------


def cmd_mcp(args: argparse.Namespace) -> int:
    """Serve the MCP server: stdio, or streamable HTTP at /mcp with ``--http HOST:PORT``."""
    try:
        from runstate.mcp import server
    except ImportError as exc:  # the extra is not installed
        raise ConfigError(f"needs the mcp package: pip install 'runstate[mcp]' ({exc})") from exc
    if args.url:
        os.environ["RUNSTATE_URL"] = args.url
    configure_tracing("runstate-mcp")
    if args.http is None:
        if args.api_key:
            os.environ["RUNSTATE_API_KEY"] = args.api_key
        server.run_stdio()
        return 0
    host, _, port = args.http.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"--http takes HOST:PORT (or :PORT), not {args.http!r}")
    server.run_http(host or "127.0.0.1", int(port))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of the ``runstate`` command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"the service's base URL (default: $RUNSTATE_URL, else {DEFAULT_URL})")
    common.add_argument("--api-key", help="the API key (default: $RUNSTATE_API_KEY)")
    common.add_argument("-v", "--verbose", action="store_true", help="log debug lines too")

    parser = argparse.ArgumentParser(prog="runstate", description="runstate's command line: workers and operators.")
    verbs = parser.add_subparsers(dest="verb", metavar="{worker,status,cancel,mcp}", required=True)

    worker = verbs.add_parser(
        "worker",
        parents=[common],
        help="run a handler on the tasks (or messages) of a mailbox under a run",
        description="Claim the run's tasks of a mailbox and run HANDLER on each; SIGTERM stops it gracefully.",
    )
    worker.add_argument("handler", help="the handler, as pkg.module:function (sync or async)")
    worker.add_argument("--mailbox", required=True, help="the mailbox to work on")
    worker.add_argument("--scope", help="the run to work under (default: $RUNSTATE_SCOPE_ID)")
    worker.add_argument("--concurrency", type=int, default=1, help="handlers running at once (default 1)")
    worker.add_argument(
        "--queue", action="store_true", help="the mailbox is a QUEUE: run the message loop (consume_messages)"
    )
    worker.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long running handlers may finish before their tasks are released (default 30)",
    )
    worker.add_argument("--lease-ttl-ms", type=int, help="lease TTL of each claim (default: the mailbox's)")
    worker.set_defaults(func=cmd_worker)

    status = verbs.add_parser(
        "status", parents=[common], help="show a run, its child runs and its groups", description="Show a run's tree."
    )
    status.add_argument("run_id", metavar="RUN_ID")
    status.add_argument("--json", action="store_true", help="print the tree as JSON")
    status.add_argument("--depth", type=int, default=3, help="levels of child runs to show (default 3)")
    status.set_defaults(func=cmd_status)

    cancel = verbs.add_parser(
        "cancel",
        parents=[common],
        help="cancel a run and everything below it",
        description="Cancel a run (idempotent); running handlers are asked to stop.",
    )
    cancel.add_argument("run_id", metavar="RUN_ID")
    cancel.add_argument("--reason", help="why (recorded on the run)")
    cancel.set_defaults(func=cmd_cancel)

    mcp = verbs.add_parser(
        "mcp",
        parents=[common],
        help="serve the MCP server for agents (stdio, or --http HOST:PORT)",
        description="An MCP server whose tools claim, heartbeat, decide and wait; see docs/mcp.md.",
    )
    mcp.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="serve streamable HTTP at /mcp (each session sends its own key as Authorization: Bearer); "
        "HOST defaults to 127.0.0.1",
    )
    mcp.set_defaults(func=cmd_mcp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``runstate`` command; return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"runstate {args.verb}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except RunstateError as exc:
        print(f"{exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_REFUSED


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
