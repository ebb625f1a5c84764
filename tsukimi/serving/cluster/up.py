"""`tsukimi up`: a whole local cluster as processes, started in order and supervised.

    tsukimi master   (mode "pd" only: the KV pool's master; the workers contribute its memory;
                      `[master] ha = N`: etcd, then N masters electing a leader: master_plan.py)
    tsukimi metadata-server  (the P2P store's records: live weight updates pull through it)
      -> tsukimi worker x N   (prefill + decode, or colocated; started together)
         + CPP prefill groups (`cpp_groups`: k `tsukimi prefill-stage` each; cpp_plan.py)
        -> tsukimi router     (the OpenAI-compatible API, 127.0.0.1:8000 by default)

Each group starts once the previous one answers GET /health with {"status": "ok"} (the router
says "ok" once it reaches every worker). The engines (workers, CPP stages) run at a lower CPU
priority than the router, master and metadata server (`workers.nice`, default 10): on a host
where they share the cores, the router's event loop runs as soon as it has work, so /health and
admission answer under overload (`tsukimi bench serve --workload overload`), while the engines
keep every cycle the router leaves. Children run in sessions of their own, log to
LOG_DIR/NAME.log, and are supervised (tsukimi/serving/cluster/supervisor.py): one that dies is started
again after a backoff (`[restart]`, a `ClusterRestartConfig`; a crash loop stops the cluster);
on Ctrl-C or SIGTERM, and when startup fails or times out, every process started gets SIGTERM
in reverse order (router, workers, master), then SIGKILL after `stop_timeout_s`. Should this
process die without stopping them (SIGKILL), each child notices through its lifeline
(tsukimi/lifeline.py) and stops itself.

The configuration is a TOML file of `ClusterConfig` (tsukimi/config/serving.py); unknown keys
are errors, absent ones take the defaults below (ports 0: free ones). Each worker gets the
settings `[workers]` gives them all (a `WorkerConfig`) with its own name, role, port and master::

    model = "smollm2"   # or "tiny", a .gguf path, a Hugging Face directory
    mode = "pd"         # prefill + decode workers over the KV pool, or "colocated"
    [workers]
    prefill = 1
    decode = 1
    colocated = 1       # used in mode "colocated"
    cpp_groups = 0      # CPP prefill groups (mode "pd"), of cpp_stages processes each
    nice = 10           # added to the engines' nice value (0: the router's priority)
    num_blocks = 512
    segment_bytes = 268435456
    [router]
    port = 8000
    health_port = 0     # /health and /metrics off the router's loop, on this port (0: none)
    [restart]
    max_restarts = 5    # within window_s = 300; backoff 0.5 s doubling up to max_backoff_s = 10
    [master]
    rpc_port = 0
    ha = 0              # 2..9: etcd + that many masters (HA); the workers join through etcd://
    hot_threshold = 0.0 # reads/s from which a pool object gets extra replicas (0 = off; SHARED_MASTER_KEYS)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from tsukimi.config import ROLES, ClusterConfig, Role, load
from tsukimi.netio import free_port
from tsukimi.serving.cluster.cpp_plan import group_processes
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster
from tsukimi.serving.cluster.master_plan import master_groups
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.serving.cluster.supervisor import Child, Supervisor
from tsukimi.serving.worker.commands import worker_args

logger = logging.getLogger(__name__)


def plan(
    config: ClusterConfig, port: Callable[[], int] | None = None, data_dir: Path = Path()
) -> list[list[ProcessSpec]]:
    """The processes of a cluster, in groups started one after the other.

    Args:
        config: the cluster.
        port: gives a free port for each port configured as 0 (default: ask the OS).
        data_dir: where etcd keeps its data (`[master] ha`; tsukimi/serving/cluster/master_plan.py).

    Raises:
        ConfigError: `[master] ha` and no etcd on PATH.
    """
    h, w = config.host, config.workers
    pick = port or (lambda: free_port(h))
    url_host = f"[{h}]" if ":" in h else h
    groups: list[list[ProcessSpec]] = [[]]
    master, master_http = "", ""
    if config.mode == "pd":
        groups, master = master_groups(config, pick, data_dir)
        master_http = groups[-1][0].url  # NOTE: the (first) master's /metrics, for the dashboard
        counts: list[tuple[Role, int]] = [("prefill", w.prefill), ("decode", w.decode)]
    else:
        counts = [("colocated", w.colocated)]
    meta_port = config.metadata_port or pick()
    groups[-1].append(
        ProcessSpec(
            "metadata",
            "metadata",
            ("metadata-server", "--host", h, "--port", str(meta_port)),
            f"http://{url_host}:{meta_port}",
        )
    )
    metadata = groups[-1][-1]
    roles = [role for role, count in counts for _ in range(count)]
    workers = []
    for i, role in enumerate(roles):
        name = f"{role}-{roles[:i].count(role)}"
        worker_port = w.base_port + i if w.base_port else pick()
        worker = dataclasses.replace(
            w.worker,
            name=name,
            role=role,
            model=config.model,
            host=h,
            port=worker_port,
            master=master,
            metadata_url=f"{metadata.url}/metadata",
        )
        workers.append(ProcessSpec(name, role, worker_args(worker), f"http://{url_host}:{worker_port}"))
    workers += group_processes(config, master, lambda j: w.base_port + len(roles) + j if w.base_port else pick())
    groups.append([dataclasses.replace(spec, nice=w.nice) for spec in workers])
    listed = ",".join(f"{s.name}={s.role}@{s.url}" for s in workers if s.role in ROLES)
    router_port = config.router.port or pick()
    args = (
        "router",
        "--host",
        h,
        "--port",
        str(router_port),
        "--model",
        config.model,
        "--workers",
        listed,
        "--mode",
        config.mode,
        "--served-model-name",
        config.router.served_model_name or config.model,
        *(("--master", master, "--master-http", master_http) if master else ()),
        *((f"--set=health_port={config.router.health_port}",) if config.router.health_port else ()),
    )
    groups.append([ProcessSpec("router", "router", args, f"http://{url_host}:{router_port}")])
    return groups


def _write_state(path: str, state: dict[str, object]) -> None:
    """Write `state` as JSON to `path`, atomically (readers never see half a file)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)


def _install_stop_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGINT and SIGTERM set `stop` (main thread only; elsewhere nothing changes); returns
    the function that restores the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


def _log_dir_for(config: ClusterConfig) -> Path:
    """The configured log directory (created), or a new temporary one."""
    if not config.log_dir:
        return Path(tempfile.mkdtemp(prefix="tsukimi-up-"))
    path = Path(config.log_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _curl_example(api_url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 32})
    return f"curl {api_url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"


def run_cluster(config: ClusterConfig, console: Console, state_file: str | None = None) -> None:
    """Start the cluster, show where to send requests, and supervise it until Ctrl-C or
    SIGTERM; every process started is stopped on the way out, whatever happens.

    Raises:
        PeerError: a process exited, or did not become healthy within startup_timeout_s.
        OSError: a process could not be spawned or its log not written.
    """
    supervisor = Supervisor(_log_dir_for(config), config.stop_timeout_s, restart=config.restart)
    model = config.router.served_model_name or config.model
    groups = plan(config, data_dir=supervisor.log_dir)
    supervise(supervisor, groups, model, config.startup_timeout_s, console, state_file)


def supervise(
    supervisor: Supervisor,
    groups: Sequence[Sequence[ProcessSpec]],
    model: str,
    startup_timeout_s: float,
    console: Console,
    state_file: str | None = None,
) -> None:
    """Starts `groups` in order (the last one's first process serves the API) through the
    launcher (tsukimi/serving/cluster/launcher.py) and supervises them until Ctrl-C or SIGTERM;
    stops every process on the way out. Raises as run_cluster."""
    stop = threading.Event()
    restore = _install_stop_signals(stop)
    config = LaunchConfig(supervisor.log_dir, startup_timeout_s, supervisor.stop_timeout_s, supervisor.verbose)
    cluster = LaunchedCluster(groups, config, supervisor)
    spawned: list[Child] = []
    try:
        if not _start(cluster, stop, console, spawned):
            console.print("interrupted while starting", highlight=False)
            return
        console.print(_summary(cluster), highlight=False)
        console.print(f"\nOpenAI API on {cluster.api}; try:\n  {_curl_example(cluster.api, model)}\n", highlight=False)
        console.print("Ctrl-C stops the cluster.", highlight=False)
        if state_file:
            _write_state(state_file, cluster.state())
        while not stop.wait(0.2):
            if cluster.tend() and state_file:  # NOTE: the restarted child's new pid
                _write_state(state_file, cluster.state())
    finally:
        if spawned:  # NOTE: a failed start has stopped them already; say so all the same
            console.print(f"stopping {len(spawned)} processes (logs in {supervisor.log_dir})")
        cluster.stop()
        restore()
        if state_file:
            Path(state_file).unlink(missing_ok=True)


def _start(cluster: LaunchedCluster, stop: threading.Event, console: Console, spawned: list[Child]) -> bool:
    """Start the groups in order, each once the previous is healthy, with a progress line per
    child (noted in `spawned`); False when interrupted. Raises as LaunchedCluster.start."""
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    tasks: dict[str, TaskID] = {}
    with Progress(*columns, console=console) as progress:

        def started(child: Child) -> None:
            spawned.append(child)
            tasks[child.spec.name] = progress.add_task(f"{child.spec.name} ({child.spec.role}): starting", total=1)

        def ready(child: Child) -> None:
            text = f"[green]{child.spec.name}[/green]: ready on {child.spec.url} (pid {child.proc.pid})"
            progress.update(tasks[child.spec.name], description=text, completed=1)

        return cluster.start(stop, started, ready)


def _summary(cluster: LaunchedCluster) -> Table:
    table = Table(title=f"tsukimi cluster (logs in {cluster.log_dir})")
    for column in ("process", "role", "pid", "url"):
        table.add_column(column)
    for p in cluster.processes:
        table.add_row(p.name, p.role, str(p.pid), p.url)
    return table


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register `tsukimi up` on the CLI's subparsers (mutates `sub`); the parser, for the
    engines' own flags (cli.py adds vLLM's: tsukimi/integrations/vllm/launch.py)."""
    up = sub.add_parser("up", help="start a local cluster (store master, workers, router) and supervise it")
    up.add_argument("--config", help="a TOML file of ClusterConfig (see tsukimi/serving/cluster/up.py)")
    up.add_argument("--set", action="append", default=[], metavar="[SECTION.]KEY=VALUE", help="override a setting")
    up.add_argument("--model", help="the model spec for every worker and the router (default: smollm2)")
    up.add_argument("--mode", choices=("pd", "colocated"), help="prefill + decode workers, or colocated ones")
    up.add_argument("--port", type=int, help="the OpenAI API's port (default 8000)")
    up.add_argument("--state-file", help="once up, write the processes' names, pids and URLs here (JSON)")
    up.add_argument("--engine", choices=("tsukimi", "vllm"), default="tsukimi", help="the workers' engine")
    return up


def run(args: argparse.Namespace, console: Console) -> None:
    """Run `tsukimi up` in the foreground until SIGINT or SIGTERM.

    Raises:
        ConfigError: bad settings. PeerError: a process died or did not start in time.
    """
    overrides = list(args.set)
    overrides += [f'model="{args.model}"'] if args.model else []
    overrides += [f'mode="{args.mode}"'] if args.mode else []
    overrides += [f"router.port={args.port}"] if args.port is not None else []
    run_cluster(load(ClusterConfig, args.config, overrides), console, args.state_file)
