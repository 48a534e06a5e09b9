"""The ``apomesh`` command line: the one composition root.

Exit codes: 0 ok, 1 failure, 2 usage. Commands that talk to a running daemon take ``--url`` (env
``APOMESH_URL``, default ``http://127.0.0.1:8750``) and ``--token`` (env ``APOMESH_TOKEN``) and go
through the SDK; without a token, when the URL is a loopback address, they use the local daemon's
(``[http] token``, else the ``<data_dir>/http.token`` it wrote at its first start; ``--data`` /
``--config`` find it), so they work against a local ``apomesh serve`` with no flags. Credentials for NATS come from the config file or ``APOMESH_NATS_*`` variables,
never from the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from apomesh._version import __version__
from apomesh.core.errors import ApomeshError

console = Console()
err = Console(stderr=True)

DEFAULT_URL = "http://127.0.0.1:8750"


def _config(args: argparse.Namespace, overrides: dict[str, dict[str, Any]]) -> Any:
    from apomesh.runtime.config import load_config

    path = Path(args.config) if getattr(args, "config", None) else None
    return load_config(path, overrides=overrides)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


# --- serve / worker / demo ---------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from apomesh.adapters.nats_connect import redact_urls
    from apomesh.api.server import serve_api
    from apomesh.runtime.node import Node

    overrides: dict[str, dict[str, Any]] = {
        "nats": {"urls": args.nats.split(",") if args.nats else None, "replicas": args.replicas},
        "daemon": {"data_dir": args.data, "workspace": args.workspace, "workers": args.workers},
        "http": {"listen": args.http},
    }
    config = _config(args, overrides)
    _setup_logging(config.daemon.log_level)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with Node(config, http=serve_api) as node:
            assert node.daemon is not None
            console.print(
                f"apomesh {__version__} serving on {node.http_url} (NATS {redact_urls(node.urls)},"
                f" data {config.daemon.data_path()}, {config.daemon.workers} local workers)"
            )
            console.print(f"boot scan: {node.daemon.boot_report}")
            await stop.wait()
            console.print("shutting down")

    asyncio.run(serve())
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    import socket

    from apomesh.adapters.nats_connect import connect, redact_urls
    from apomesh.runtime.nats_permissions import credential_identity
    from apomesh.runtime.node import make_plugin_host, nats_options
    from apomesh.runtime.protocol import check_worker_id, new_worker_id, worker_inbox_prefix
    from apomesh.runtime.worker import Worker

    config = _config(
        args,
        {
            "nats": {"urls": args.nats.split(",") if args.nats else None},
            "workers": {"max_agents": args.max_agents},
        },
    )
    _setup_logging(config.daemon.log_level)
    if not config.nats.urls:
        err.print("a worker needs NATS: --nats URL, [nats] urls or APOMESH_NATS_URLS")
        return 2
    workspace = Path(args.workspace or "workspace").absolute()
    # The id comes from the credentials unless given: NATS permissions name it, so a worker can
    # only beat, report and take dispatches as the identity it authenticated as.
    worker_id = args.id or credential_identity(config.nats)
    name = args.name or worker_id or socket.gethostname()
    if worker_id is not None:
        try:
            check_worker_id(worker_id)
        except ValueError as exc:
            err.print(f"[red]error[/]: {exc}; give a usable one with --id")
            return 2
    else:
        worker_id = new_worker_id(name)
    # The daemon answers a worker only on its own inbox.
    connect_options = {**nats_options(config), "inbox_prefix": worker_inbox_prefix(worker_id)}

    async def work() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        plugins = make_plugin_host(config)
        nc = await connect(
            config.nats.urls,
            name=f"apomesh-worker-{worker_id}",
            **connect_options,
        )
        worker = Worker(
            nc,
            tools=plugins.tools(),
            providers=plugins.model_providers(),
            supervisors=list(plugins.supervisor_policies().values()),
            plugin_versions=plugins.installed_versions(),
            workspace=workspace,
            name=name,
            worker_id=worker_id,
            heartbeat_interval=config.liveness.heartbeat_interval,
            max_agents=config.workers.max_agents,
            daemon_gone_after=config.workers.daemon_gone_after,
            mcp_servers=config.mcp.servers,
        )
        await worker.start()
        console.print(
            f"worker {worker.worker_id} on {redact_urls(config.nats.urls)}, workspace {workspace},"
            f" {worker.max_agents} agents at most"
        )
        await stop.wait()
        await worker.aclose()
        await nc.close()

    asyncio.run(work())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from apomesh.demo import run_demo

    logging.basicConfig(level=logging.ERROR)
    return asyncio.run(run_demo(console))


# --- commands that talk to a daemon -----------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from apomesh.sdk.client import SyncClient, local_token

    token = args.token or local_token(args.url, _config(args, {"daemon": {"data_dir": args.data}}))
    return SyncClient(args.url, token=token)


def _load_definition(path: str) -> dict[str, Any]:
    from apomesh.runtime.composition import load_definition_file

    return load_definition_file(Path(path))


def cmd_run(args: argparse.Namespace) -> int:
    from apomesh.builtin.agents import DEFAULT_AGENT

    client = _client(args)
    if args.agent:
        session_id = client.start_session(args.goal, agent=args.agent)
    else:
        definition = _load_definition(args.definition) if args.definition else DEFAULT_AGENT
        session_id = client.start_session(args.goal, definition=definition)
    console.print(f"session {session_id}")
    if not args.follow:
        return 0
    return _follow(client, session_id)


def _follow(client: Any, session_id: str) -> int:
    from rich.live import Live
    from rich.tree import Tree

    def render() -> Tree:
        view = client.get_session(session_id)
        tree = Tree(f"[bold]{view.session_id}[/] {view.status} — {view.goal}")
        nodes: dict[str, Any] = {}
        for agent in view.agents:
            label = f"{agent.ref} [cyan]{agent.phase}[/]"
            if agent.worker:
                label += f" on {agent.worker}"
            if agent.resuming:
                label += " [yellow](resuming)[/]"
            elif agent.resumes:
                label += f" [green](resumed x{agent.resumes})[/]"
            parent = nodes.get(agent.parent or "", tree)
            nodes[agent.ref] = parent.add(label)
        return tree

    with Live(render(), console=console, refresh_per_second=4) as live:
        for record in client.events(session_id):
            live.update(render())
            if record.kind == "SessionEnded":
                break
    if not console.is_terminal:
        # rich ends the last frame with a newline only on a terminal; a pipe needs its own.
        console.line()
    view = client.get_session(session_id)
    console.print(f"{view.status}: {view.output or view.reason or ''}")
    return 0 if view.status == "completed" else 1


def cmd_sessions(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "list":
        table = Table("session", "status", "goal", "events", "side effects")
        for s in client.list_sessions(status=args.status, query=args.query):
            table.add_row(
                s.session_id, s.status, s.goal, str(s.last_index + 1), str(s.side_effects)
            )
        console.print(table)
        return 0
    if not args.id:
        err.print("a session id is needed")
        return 2
    if args.action == "show":
        view = client.get_session(args.id)
        console.print_json(data=_builtins(view))
        return 0
    if args.action == "tail":
        for record in client.events(args.id, after=args.after):
            console.print(
                f"{record.index:>5} {record.kind} {json.dumps(record.event, default=str)[:160]}"
            )
        return 0
    if args.action == "verify":
        report = client.verify_session(args.id)
        console.print_json(data=report)
        return 0 if report.get("ok") else 1
    return 2


def cmd_daemons(args: argparse.Namespace) -> int:
    import time

    client = _client(args)
    if args.action == "list":
        daemons = client.list_daemons()
        if args.json:
            print(json.dumps(_builtins(daemons)))
            return 0
        table = Table("daemon", "host", "state", "sessions", "stranded", "load", "lease age", "url")
        for d in daemons:
            table.add_row(
                d.id + (" (this)" if d.this else ""),
                d.host,
                d.state,
                str(d.sessions),
                str(d.stranded),
                str(d.load),
                f"{d.lease_age:.1f}s",
                d.url,
            )
        console.print(table)
        return 0
    if not args.id:
        err.print("a daemon id is needed")
        return 2
    client.drain_daemon(args.id)
    console.print(f"daemon {args.id} drains: its sessions move to the live peers")
    if args.wait:
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline:
            row = next((d for d in client.list_daemons() if d.id == args.id), None)
            if row is None or row.state == "drained":
                console.print(f"daemon {args.id} drained")
                return 0
            time.sleep(0.2)
        err.print(f"daemon {args.id} did not finish draining within {args.wait:.0f} s")
        return 1
    return 0


FILTER_KEYS = ("category", "reason", "goal")


def _resume_all(client: Any, args: argparse.Namespace) -> int:
    """``recover resume --all [--filter KEY=VALUE ...]``: show every matching session and what
    resuming it faces, ask once, then resume exactly the sessions shown."""
    from apomesh.core.views import RecoverableFilter

    if args.id or args.migrate_pin:
        err.print("--all resumes by filter: no session id and no --migrate-pin with it")
        return 2
    wanted: dict[str, str] = {}
    for item in args.filter or []:
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in FILTER_KEYS or not value.strip():
            err.print(f"--filter wants one of {', '.join(FILTER_KEYS)} as KEY=VALUE, not {item!r}")
            return 2
        wanted[key.strip()] = value.strip()
    which = RecoverableFilter(
        category=wanted.get("category"), reason=wanted.get("reason"), goal=wanted.get("goal")
    )
    chosen = [r for r in client.list_recoverable() if which.matches(r)]
    if not chosen:
        console.print("no recoverable session matches")
        return 0
    for r in chosen:
        console.print(f"{r.session_id}  {r.goal!r}  {r.category}: {r.reason}")
        for u in r.unknown_outcomes:
            console.print(
                f"  [yellow]outcome unknown (not run again):[/] {u.agent} {u.tool} {json.dumps(u.args)}"
            )
        for d in r.pin_diff:
            console.print(
                f"  [yellow]pin differs:[/] {d.name}: {d.old} -> {d.new or 'not installed'}"
            )
    if not args.yes:
        if not sys.stdin.isatty():
            err.print(
                f"refusing to resume {len(chosen)} sessions without a terminal to ask; pass --yes"
            )
            return 2
        if console.input(f"resume these {len(chosen)} sessions? [y/N] ").strip().lower() not in (
            "y",
            "yes",
        ):
            return 1
    outcomes = client.resume_matching(
        category=which.category,
        reason=which.reason,
        goal=which.goal,
        session_ids=[r.session_id for r in chosen],
    )
    for o in outcomes:
        if o.outcome == "resumed":
            console.print(f"resumed {o.session_id}")
        else:
            err.print(f"refused {o.session_id}: {o.error}: {o.message}")
    return 0 if all(o.outcome == "resumed" for o in outcomes) else 1


def cmd_recover(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "list":
        table = Table("session", "goal", "category", "reason", "side effects", "last event")
        for r in client.list_recoverable():
            table.add_row(
                r.session_id,
                r.goal,
                r.category,
                r.reason,
                str(r.side_effects),
                _when(r.last_event_at),
            )
        console.print(table)
        return 0
    if args.all:
        return _resume_all(client, args)
    if args.filter:
        err.print("--filter goes with --all")
        return 2
    if not args.id:
        err.print("a session id is needed (or --all)")
        return 2
    migrate: dict[str, str] = {}
    for pin in args.migrate_pin or []:
        name, sep, version = pin.partition("=")
        if not sep or not name.strip() or not version.strip():
            err.print(f"--migrate-pin wants NAME=VERSION, not {pin!r}")
            return 2
        migrate[name.strip()] = version.strip()
    preview = client.recovery_preview(args.id, migrate_pins=migrate or None)
    if preview.unknown_outcomes:
        console.print(
            "[yellow]side effects whose outcome is unknown (they will not be run again):[/]"
        )
        for u in preview.unknown_outcomes:
            console.print(f"  {u.agent} {u.tool} {json.dumps(u.args)}")
    if preview.pin_diff:
        console.print("[yellow]pins that differ from what is installed:[/]")
        for d in preview.pin_diff:
            console.print(f"  {d.name}: {d.old} -> {d.new or 'not installed'}")
    agent = preview.agent_diff
    if agent is not None:
        console.print(f"[yellow]moving the agent {agent.old} -> {agent.new}:[/]")
        console.print(f"  definition digest {agent.old_digest[:12]} -> {agent.new_digest[:12]}")
        for skill in agent.skills:
            old_digest, new_digest = (skill.old or "none")[:12], (skill.new or "none")[:12]
            console.print(f"  skill {skill.name}: {old_digest} -> {new_digest}")
        if agent.coordination[0] != agent.coordination[1]:
            console.print(f"  coordination {agent.coordination[0]} -> {agent.coordination[1]}")
        if agent.coordination_params[0] != agent.coordination_params[1]:
            params = [json.dumps(p, sort_keys=True) for p in agent.coordination_params]
            console.print(f"  coordination params {params[0]} -> {params[1]}")
        for change in agent.plugins:
            console.print(
                f"  plugin {change.name}: {change.old or 'none'} -> {change.new or 'none'}"
            )
        if agent.roles:
            console.print(f"  configs that change: {', '.join(agent.roles)}")
        if agent.problem:
            console.print(f"[red]refused: {agent.problem}[/]")
            return 1
    for name, version in migrate.items():
        if name == "agent" and agent is not None:
            old = agent.old.partition("@")[2]
        else:
            old = next((d.old for d in preview.pin_diff if d.name == name), "?")
        console.print(f"migrating pin {name}: {old} -> {version}")
    if (
        not args.yes
        and sys.stdin.isatty()
        and console.input("resume? [y/N] ").strip().lower() not in ("y", "yes")
    ):
        return 1
    client.resume(args.id, migrate_pins=migrate or None, confirm=True)
    console.print(f"resumed {args.id}")
    return 0


def cmd_hitl(args: argparse.Namespace) -> int:
    _client(args).answer_hitl(args.session, args.pause, args.text)
    console.print("answered")
    return 0


def cmd_skills(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "put":
        if not args.name or not args.file:
            err.print("usage: apomesh skills put NAME FILE")
            return 2
        # Decoded from bytes: a text-mode read would turn CRLF into LF and store other bytes.
        view = client.put_skill(args.name, Path(args.file).read_bytes().decode("utf-8"))
        console.print(f"skill {view.name} revision {view.revision} digest {view.digest[:12]}")
    elif args.action == "list":
        table = Table("skill", "revision", "digest")
        for s in client.list_skills():
            table.add_row(s.name, str(s.revision), s.digest[:12])
        console.print(table)
    elif not args.name:
        err.print(f"usage: apomesh skills {args.action} NAME")
        return 2
    elif args.action == "get":
        # The exact body, byte for byte: no markup, no wrapping, no added newline.
        sys.stdout.write(client.get_skill(args.name).body)
        sys.stdout.flush()
    elif args.action == "history":
        table = Table("skill", "revision", "digest", "first line")
        for s in client.skill_history(args.name):
            table.add_row(s.name, str(s.revision), s.digest[:12], s.body.partition("\n")[0][:60])
        console.print(table)
    elif args.action == "rm":
        client.delete_skill(args.name)
        console.print(f"deleted {args.name}")
    return 0


def cmd_agents(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action in ("publish", "show") and not args.target:
        err.print(
            f"usage: apomesh agents {args.action} {'FILE' if args.action == 'publish' else 'NAME[@VERSION]'}"
        )
        return 2
    if args.action == "publish":
        created, record = client.publish_agent(_load_definition(args.target))
        console.print(
            f"{'published' if created else 'already published (same content)'} {record.name}@{record.version}"
        )
    elif args.action == "list":
        table = Table("agent", "version", "digest", "skills")
        for a in client.list_agents():
            table.add_row(a.name, a.version, a.digest[:12], ", ".join(a.skills))
        console.print(table)
    elif args.action == "show":
        name, _, version = args.target.partition("@")
        console.print_json(data=_builtins(client.get_agent(name, version or None)))
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from apomesh.plugins.manager import PluginHost

    host = PluginHost()
    table = Table("plugin", "version", "hooks", "provides")
    for info in host.plugins():
        table.add_row(info.name, info.version, "\n".join(info.hooks), "\n".join(info.registered))
    console.print(table)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from apomesh.runtime.config import sample_config

    sys.stdout.write(sample_config())
    return 0


def cmd_tokens(args: argparse.Namespace) -> int:
    from apomesh.api.tokens import TokenStore

    data = Path(args.data).absolute() if args.data else _config(args, {}).daemon.data_path()
    store = TokenStore.in_dir(data)
    if args.action == "create":
        try:
            lifetime = _duration(args.expires_in) if args.expires_in else None
        except ValueError as exc:
            err.print(f"[red]error[/]: --expires-in: {exc}")
            return 2
        token_id, secret = store.create(args.role, args.name or args.role, expires_in=lifetime)
        until = f", expires {_when(time.time() + lifetime)}" if lifetime else ""
        console.print(f"token {token_id} ({args.role}{until}); shown once:")
        print(secret)
    elif args.action == "list":
        table = Table("id", "name", "role", "created", "expires")
        now = time.time()
        for t in store.list():
            expires = _when(t.expires_at) if t.expires_at else "never"
            if t.expired(now):
                expires += " (expired)"
            table.add_row(t.token_id, t.name, t.role, _when(t.created_at), expires)
        console.print(table)
    elif args.action == "revoke":
        if not args.id:
            err.print("usage: apomesh tokens revoke ID (see `apomesh tokens list`)")
            return 2
        if not store.revoke(args.id):
            err.print(f"[red]error[/]: no token {args.id} in {store.path}")
            return 1
        console.print(f"revoked {args.id}")
    return 0


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h`` or ``30d`` in seconds."""
    value = text.strip().lower()
    unit = _DURATION_UNITS.get(value[-1:], 0)
    number = value[:-1] if unit else value
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration such as 90s, 15m, 12h or 30d") from None
    if seconds <= 0:
        raise ValueError(f"{text!r} is not a positive duration")
    return seconds


def _when(ts: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ts).isoformat(timespec="seconds") if ts else "-"


def _builtins(obj: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(obj)


# --- parser ------------------------------------------------------------------------------------------


def _remote(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get("APOMESH_URL", DEFAULT_URL),
        help="the daemon's HTTP API (env APOMESH_URL)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("APOMESH_TOKEN"),
        help="an API token (env APOMESH_TOKEN; default: [http] token, else the token the daemon"
        " wrote to <data_dir>/http.token)",
    )
    p.add_argument(
        "--data", help="the local daemon's data directory, where its first token is kept"
    )
    p.add_argument("--config", help="the local daemon's config file ([http] token, data_dir)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apomesh", description="Durable agent sessions on NATS JetStream."
    )
    parser.add_argument("--version", action="version", version=f"apomesh {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the daemon (embedded NATS unless --nats is given)")
    p.add_argument("--nats", help="NATS URL(s), comma-separated; none starts an embedded server")
    p.add_argument("--replicas", type=int, help="stream and bucket replicas (3 in a cluster)")
    p.add_argument("--data", help="data directory (LMDB, embedded NATS store)")
    p.add_argument("--workspace", help="workspace directory of the local workers")
    p.add_argument("--http", help="HOST:PORT of the HTTP API (default 127.0.0.1:8750)")
    p.add_argument("--workers", type=int, help="local in-process workers (default 2; 0 allowed)")
    p.add_argument("--config", help="config file (see `apomesh config sample`)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("worker", help="run a worker that connects to NATS")
    p.add_argument("--nats", help="NATS URL(s), comma-separated (or [nats] urls in --config)")
    p.add_argument("--name", help="a name shown in `GET /v1/workers`")
    p.add_argument(
        "--id",
        help="the worker id (default: the NATS user, NKey or creds name it authenticates as,"
        " else NAME-<random>); NATS permissions bind it to the credentials",
    )
    p.add_argument("--workspace", help="the directory file tools are confined to")
    p.add_argument(
        "--max-agents",
        type=int,
        help="how many agents it runs at once, for every daemon together (default 8;"
        " [workers] max_agents)",
    )
    p.add_argument(
        "--config",
        help="config file (credentials, TLS); secrets also come from APOMESH_NATS_* variables,"
        " never from the command line",
    )
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser(
        "demo", help="run a self-contained demo: a worker is killed mid-run and resumed"
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("run", help="start a session")
    p.add_argument("goal")
    p.add_argument("--agent", help="a published agent NAME[@VERSION]")
    p.add_argument("--definition", help="an agent definition TOML file")
    p.add_argument(
        "--follow", action="store_true", help="show the spawn tree live until the session ends"
    )
    _remote(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("sessions", help="list, show, tail or verify sessions")
    p.add_argument("action", choices=["list", "show", "tail", "verify"])
    p.add_argument("id", nargs="?")
    p.add_argument("--status")
    p.add_argument("--query")
    p.add_argument("--after", type=int, default=-1)
    _remote(p)
    p.set_defaults(func=cmd_sessions)

    p = sub.add_parser("daemons", help="list the live daemons, or drain one for maintenance")
    p.add_argument("action", choices=["list", "drain"])
    p.add_argument("id", nargs="?", help="the daemon to drain (an id from `daemons list`)")
    p.add_argument("--json", action="store_true", help="list as JSON")
    p.add_argument(
        "--wait", type=float, default=0.0, help="seconds to wait until the daemon has drained"
    )
    _remote(p)
    p.set_defaults(func=cmd_daemons)

    p = sub.add_parser(
        "recover",
        help="list recoverable sessions or resume one (or all that match a filter)",
        description="List sessions waiting for an operator, or resume one after seeing what "
        "resuming would face. --migrate-pin moves a stranded session first: PLUGIN=VERSION to "
        "the installed version of a plugin it pins, agent=VERSION to another published version "
        "of the agent it was started from (the coordination kind must stay the same). Both are "
        "logged as OperatorAction(migrate_pin).",
    )
    p.add_argument("action", choices=["list", "resume"])
    p.add_argument("id", nargs="?")
    p.add_argument(
        "--migrate-pin",
        action="append",
        metavar="NAME=VERSION",
        help="move a pin before resuming (repeatable): a plugin's distribution name, or `agent` "
        "for another published version of the session's agent; the difference is shown first",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="resume every recoverable session (that --filter keeps), after showing each one",
    )
    p.add_argument(
        "--filter",
        action="append",
        metavar="KEY=VALUE",
        help="with --all, keep only sessions whose category is VALUE (category=held), or whose "
        "reason or goal contains VALUE (reason=..., goal=...); repeatable, all must match",
    )
    p.add_argument("--yes", action="store_true", help="resume without asking")
    _remote(p)
    p.set_defaults(func=cmd_recover)

    p = sub.add_parser("hitl", help="answer a human-in-the-loop pause")
    p.add_argument("action", choices=["answer"])
    p.add_argument("session")
    p.add_argument("pause")
    p.add_argument("text")
    _remote(p)
    p.set_defaults(func=cmd_hitl)

    p = sub.add_parser("skills", help="the skill catalog")
    p.add_argument("action", choices=["put", "get", "list", "history", "rm"])
    p.add_argument("name", nargs="?")
    p.add_argument("file", nargs="?")
    _remote(p)
    p.set_defaults(func=cmd_skills)

    p = sub.add_parser("agents", help="published agents")
    p.add_argument("action", choices=["publish", "list", "show"])
    p.add_argument("target", nargs="?", help="FILE for publish, NAME[@VERSION] for show")
    _remote(p)
    p.set_defaults(func=cmd_agents)

    p = sub.add_parser("plugins", help="installed plugins")
    p.add_argument("action", choices=["list"])
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("config", help="configuration")
    p.add_argument("action", choices=["sample"])
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("tokens", help="API tokens (stored hashed in the data dir)")
    p.add_argument("action", choices=["create", "list", "revoke"])
    p.add_argument("id", nargs="?")
    p.add_argument("--role", choices=["read", "operator"], default="read")
    p.add_argument("--name")
    p.add_argument(
        "--expires-in",
        metavar="DURATION",
        help="lifetime of a new token: 90s, 15m, 12h, 30d (default: until revoked)",
    )
    p.add_argument(
        "--data", help="the daemon's data directory (default: [daemon] data_dir of --config)"
    )
    p.add_argument("--config", help="the daemon's config file, to find its data directory")
    p.set_defaults(func=cmd_tokens)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ApomeshError as exc:
        # Escaped: a message that names a config section ("[nats] ...") is not markup.
        err.print(f"[red]error[/] ({exc.code}): {escape(exc.message)}")
        return 1
    except (OSError, tomllib.TOMLDecodeError) as exc:
        err.print(f"[red]error[/]: {exc}")
        return 1
    except KeyboardInterrupt:
        return 1
    except Exception as exc:  # the SDK's typed errors and anything unexpected
        name = type(exc).__name__
        if name.endswith("Error") or name == "ServerUnavailable":
            err.print(f"[red]error[/] ({name}): {exc}")
            if name == "UnauthorizedError":
                err.print(
                    "give a token with --token or APOMESH_TOKEN (`apomesh tokens create`), or"
                    " --data DIR of the daemon, whose first token is in DIR/http.token"
                )
            return 1
        raise
