"""`tsukimi up --engine vllm`: vLLM API servers from `.venv-vllm`, the KV pool's master when
a connector needs one, and `tsukimi router --backend vllm` in front, supervised like
`tsukimi up` (tsukimi/serving/cluster/up.py: started in groups, each once the previous answers
/health; Ctrl-C, SIGTERM or a dead child stops them all, each child's whole session).

    [master]        tsukimi master (connector "tsukimi") or mooncake_master ("mooncake_store")
    vllm-0..N-1     python -m vllm.entrypoints.openai.api_server --model .models/MODEL
                      --dtype float32 --kv-events-config {zmq publisher on a free port + replay}
                      [--kv-transfer-config TsukimiConnector | MooncakeStoreConnector]
                      env VLLM_CPU_OMP_THREADS_BIND=<its core> VLLM_CPU_KVCACHE_SPACE=<GiB>
                      TMPDIR=VLLM_RPC_BASE_PATH=<its work folder> VLLM_USE_AOT_COMPILE=0
    router          tsukimi router --backend vllm --model .models/MODEL --workers ... --kv-events ...

Models are the folders `make vllm` builds under `.models/` (tiny, smollm2), or any Hugging
Face folder given by path. Where the venv and the models are comes from the flags
(`--vllm-venv`, `--models-dir`), else the environment ($TSUKIMI_VLLM_VENV, $TSUKIMI_MODELS_DIR),
else `.venv-vllm` and `.models` in the current directory (tsukimi/integrations/vllm/paths.py).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rich.console import Console

from tsukimi.errors import ConfigError
from tsukimi.integrations.vllm import leftovers, paths
from tsukimi.netio import free_port

if TYPE_CHECKING:
    from tsukimi.serving.cluster.process_spec import ProcessSpec

Connector = Literal["none", "tsukimi", "mooncake_store"]
CONNECTORS: tuple[Connector, ...] = ("none", "tsukimi", "mooncake_store")
CONNECTOR_MODULE = "tsukimi.integrations.vllm.connector"
MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LEGACY_RPC_PORT_BINDING": "1"}


@dataclass(frozen=True, slots=True)
class VllmClusterConfig:
    """A local vLLM cluster. model: "tiny", "smollm2" (under `models_dir`) or a folder.
    mode: `instances` colocated servers, or one prefill and one decode ("pd"). connector:
    none, tsukimi's pool (TsukimiConnector) or vLLM's MooncakeStoreConnector on the real
    Mooncake. prefix_caching: vLLM's local one. policy: the router's placement.
    kv_cache_gib: VLLM_CPU_KVCACHE_SPACE. pool_segment_bytes: memory each instance adds to
    the pool. venv / models_dir: the vLLM virtualenv and the models' folder, by default from
    $TSUKIMI_VLLM_VENV / $TSUKIMI_MODELS_DIR, else .venv-vllm / .models in the current
    directory (read when the config is made). log_dir: "" for a new temporary one."""

    model: str = "tiny"
    mode: Literal["colocated", "pd"] = "colocated"
    instances: int = 2
    connector: Connector = "none"
    prefix_caching: bool = True
    policy: Literal["conductor", "round_robin"] = "conductor"
    host: str = "127.0.0.1"
    router_port: int = 0
    kv_cache_gib: float = 1.0
    pool_segment_bytes: int = 256 << 20
    max_model_len: int = 0  # 0: the model's own
    venv: str = field(default_factory=lambda: str(paths.vllm_venv()))
    models_dir: str = field(default_factory=lambda: str(paths.models_dir()))
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 20.0
    log_dir: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("colocated", "pd") or self.connector not in CONNECTORS:
            raise ConfigError(f"mode must be colocated or pd and connector one of {CONNECTORS}")
        if self.instances < 1 or (self.mode == "pd" and self.instances != 2):
            raise ConfigError("colocated needs >= 1 instance; pd runs exactly 2 (a prefill and a decode)")
        if self.mode == "pd" and self.connector == "none":
            raise ConfigError("pd needs a connector to hand the KV over (--connector tsukimi)")

    @property
    def python(self) -> Path:
        """The venv's interpreter (absolute)."""
        return paths.venv_python(self.venv)

    def model_path(self) -> Path:
        """The model's folder (absolute). Raises ConfigError naming `make vllm` and the flag and
        variable to set when it or the venv is absent."""
        paths.check_venv(self.venv)
        return paths.model_folder(self.model, self.models_dir)


def _connector_config(config: VllmClusterConfig, role: str, master: str) -> dict[str, object] | None:
    if config.connector == "tsukimi":
        kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(role, "kv_both")
        extra = {"master": master, "segment_bytes": config.pool_segment_bytes}
        return {
            "kv_connector": "TsukimiConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": kv_role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    if config.connector == "mooncake_store":
        return {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"load_async": True},
        }
    return None


def vllm_process(
    config: VllmClusterConfig, index: int, role: str, master: str, pick: Callable[[], int], workdir: Path
) -> tuple[ProcessSpec, str]:
    """One vLLM API server's process and its `--kv-events` item (pure but for `pick`)."""
    from tsukimi.serving.cluster.process_spec import ProcessSpec

    name, h, port = f"vllm-{index}", config.host, pick()
    # NOTE: vLLM binds its PUB socket only to "tcp://*:P" (every interface) or ipc://, and
    # connects it to anything else: an ipc socket in the log folder stays on this host.
    events, replay = f"ipc://{workdir.resolve()}/{name}-events", f"ipc://{workdir.resolve()}/{name}-replay"
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events,
        "replay_endpoint": replay,
        "topic": "kv",
    }
    argv = [
        str(config.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(config.model_path()),
        "--served-model-name",
        config.model,
        "--host",
        h,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(kv_events),
    ]
    argv += ["--max-model-len", str(config.max_model_len)] if config.max_model_len else []
    argv += [] if config.prefix_caching else ["--no-enable-prefix-caching"]
    transfer = _connector_config(config, role, master)
    argv += ["--kv-transfer-config", json.dumps(transfer)] if transfer else []
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": str(index % max(1, os.cpu_count() or 1)),
        "VLLM_CPU_KVCACHE_SPACE": f"{config.kv_cache_gib:g}",
        "VLLM_HOST_IP": h,
        "VLLM_RPC_BASE_PATH": str(workdir.resolve()),  # NOTE: its ipc sockets, else left in /tmp
        "TMPDIR": str(workdir.resolve()),  # NOTE: its `vllm_dist_*` rendezvous files, else left in /tmp
        # NOTE: vLLM 0.32 on torch 2.13 saves its AOT-compiled model but cannot load it back
        # ("'function' object has no attribute 'finalize_loading'"): every start compiled again
        "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0"),
        **MOONCAKE_ENV,
    }
    if config.connector == "mooncake_store":
        path = workdir / f"{name}-mooncake.json"
        path.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master,
                    "protocol": "tcp",
                    "device_name": "",
                    "global_segment_size": config.pool_segment_bytes,
                    "local_buffer_size": 64 << 20,
                }
            )
        )
        env |= {"MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": f"{h}:{pick()}"}
    spec = ProcessSpec(name, role, (), f"http://{h}:{port}", tuple(argv), tuple(env.items()), "http")
    return spec, f"{name}={events}+{replay}"


def plan_vllm(
    config: VllmClusterConfig, workdir: Path, pick: Callable[[], int] | None = None
) -> list[list[ProcessSpec]]:
    """The cluster's processes in start order. Raises ConfigError (venv or model missing)."""
    from tsukimi.serving.cluster.process_spec import ProcessSpec

    h = config.host
    port = pick or (lambda: free_port(h))
    groups: list[list[ProcessSpec]] = []
    master = ""
    if config.connector == "tsukimi":
        rpc, http = port(), port()
        sets = (f'master.host="{h}"', f"master.rpc_port={rpc}", f"master.http_port={http}")
        groups.append(
            [ProcessSpec("master", "master", ("master", *(f"--set={s}" for s in sets)), f"http://{h}:{http}")]
        )
        master = f"tcp://{h}:{rpc}"
    elif config.connector == "mooncake_store":
        binary, rpc = Path(config.venv).absolute() / "bin" / "mooncake_master", port()
        if not binary.exists():
            raise ConfigError(f"{binary} is missing: pip install mooncake-transfer-engine-non-cuda into {config.venv}")
        metrics = port()
        argv = (
            str(binary),
            f"--rpc_port={rpc}",
            f"--rpc_address={h}",
            f"--metrics_host={h}",
            f"--metrics_port={metrics}",
            "--logtostderr",
        )
        groups.append(
            [
                ProcessSpec(
                    "mooncake-master", "master", (), f"http://{h}:{metrics}", argv, tuple(MOONCAKE_ENV.items()), "http"
                )
            ]
        )
        master = f"{h}:{rpc}"
    roles = ["prefill", "decode"] if config.mode == "pd" else ["colocated"] * config.instances
    made = [vllm_process(config, i, role, master, port, workdir) for i, role in enumerate(roles)]
    groups.append([spec for spec, _ in made])
    workers = ",".join(f"{s.name}={s.role}@{s.url}" for s, _ in made)
    args = [
        "router",
        "--backend",
        "vllm",
        "--host",
        h,
        "--port",
        str(config.router_port or port()),
        "--workers",
        workers,
        "--kv-events",
        ",".join(e for _, e in made),
        "--policy",
        config.policy,
        "--model",  # NOTE: the router tokenizes with the served model's own tokenizer
        str(config.model_path()),
        "--served-model-name",
        config.model,
    ]
    args += ["--pool"] if config.connector != "none" else []
    groups.append([ProcessSpec("router", "router", tuple(args), f"http://{h}:{args[args.index('--port') + 1]}")])
    return groups


def add_vllm_up_arguments(up: argparse.ArgumentParser) -> None:
    """`tsukimi up`'s flags for `--engine vllm` (mutates `up`)."""
    g = up.add_argument_group("--engine vllm")
    g.add_argument("--instances", type=int, default=2, help="colocated vLLM instances (default 2)")
    g.add_argument("--connector", choices=CONNECTORS, default="none", help="KV pool connector (pd needs one)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn vLLM's local prefix caching off")
    g.add_argument("--policy", choices=("conductor", "round_robin"), default="conductor", help="router placement")
    g.add_argument("--log-dir", default="", help="where the processes log (default: a new temporary folder)")
    g.add_argument(
        "--vllm-venv",
        default=None,
        help=f"the virtualenv with vllm-cpu (default: ${paths.VENV_ENV}, else {paths.DEFAULT_VENV} here)",
    )
    g.add_argument(
        "--models-dir",
        default=None,
        help=f"the folder of the models (default: ${paths.MODELS_ENV}, else {paths.DEFAULT_MODELS} here)",
    )


def cluster_config(args: argparse.Namespace) -> VllmClusterConfig:
    """The cluster `tsukimi up --engine vllm`'s flags describe (reads the environment for the
    venv and models the flags do not give). Raises ConfigError."""
    return VllmClusterConfig(
        model=args.model or "tiny",
        mode=args.mode or "colocated",
        instances=args.instances,
        connector=args.connector,
        prefix_caching=not args.no_prefix_caching,
        policy=args.policy,
        router_port=args.port or 8000,
        log_dir=args.log_dir,
        venv=args.vllm_venv or str(paths.vllm_venv()),
        models_dir=args.models_dir or str(paths.models_dir()),
    )


def run_vllm_cluster(args: argparse.Namespace, console: Console) -> None:
    """`tsukimi up --engine vllm` in the foreground until Ctrl-C or SIGTERM.

    Raises:
        ConfigError: bad flags, or the vLLM venv or the model folder missing (run make vllm).
        PeerError: a process died or did not start in time.
    """
    import tempfile

    from tsukimi.serving.cluster.supervisor import Supervisor
    from tsukimi.serving.cluster.up import supervise

    config = cluster_config(args)
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="tsukimi-up-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    groups = plan_vllm(config, log_dir)
    supervisor = Supervisor(log_dir, config.stop_timeout_s)
    with leftovers.swept():  # NOTE: vLLM's message-queue files in /dev/shm, once every process stopped
        supervise(supervisor, groups, config.model, config.startup_timeout_s, console, args.state_file)
