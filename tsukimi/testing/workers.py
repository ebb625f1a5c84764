"""Inference workers as real processes, for tests: one `tsukimi worker` per `WorkerConfig`,
started together through the cluster launcher (tsukimi/serving/cluster/launcher.py, as `tsukimi
up` starts them), each answering /health before the block is entered, all stopped after
(SIGTERM, then SIGKILL). A worker that exits or does not come up in time fails the start with
the end of its log (LOG_DIR/NAME.log).

    configs = [WorkerConfig(name="prefill", role="prefill", model="tiny", port=free_port(), ...), ...]
    with launched_workers(configs, tmp_path) as urls:      urls: name -> http://host:port
    pd_configs(master, segment_bytes)                      the usual pair: tiny prefill + decode
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from tsukimi.config import WorkerConfig
from tsukimi.errors import ConfigError
from tsukimi.netio import free_port
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.serving.worker.commands import worker_args


def pd_configs(master: str, segment_bytes: int, num_blocks: int = 256, prefill_blocks: int = 0) -> list[WorkerConfig]:
    """A tiny prefill worker and a tiny decode worker (named so) on the store `master`, each
    giving it `segment_bytes` and holding `num_blocks` KV blocks (the prefill worker
    `prefill_blocks` when set: a small cache that evicts), on free ports (pure but for the ports)."""
    return [
        WorkerConfig(
            name=role,
            role=role,
            model="tiny",
            port=free_port(),
            master=master,
            segment_bytes=segment_bytes,
            num_blocks=prefill_blocks if role == "prefill" and prefill_blocks else num_blocks,
        )
        for role in ("prefill", "decode")
    ]


def worker_spec(config: WorkerConfig, env: Mapping[str, str] | None = None) -> ProcessSpec:
    """The process of one worker (pure): `tsukimi worker` with `config`'s flags; `env`: variables
    added to the environment (e.g. PYTHONPATH for an engine factory that lives in tests/)."""
    host = f"[{config.host}]" if ":" in config.host else config.host
    return ProcessSpec(
        config.name, config.role, worker_args(config), f"http://{host}:{config.port}", env=tuple((env or {}).items())
    )


@contextlib.contextmanager
def launched_workers(
    configs: Sequence[WorkerConfig],
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 120.0,
) -> Iterator[dict[str, str]]:
    """Start the workers (see the module); their base URLs by name while the block runs.

    Raises:
        ConfigError: a config without a port (0: the URL would be unknown).
        PeerError: a worker exited or was not healthy within `startup_timeout_s`.
    """
    if any(c.port == 0 for c in configs):
        raise ConfigError("each worker needs its own port (free_port()), not 0")
    log_dir.mkdir(parents=True, exist_ok=True)
    specs = [worker_spec(c, env) for c in configs]
    with LaunchedCluster([specs], LaunchConfig(log_dir, startup_timeout_s=startup_timeout_s, stop_timeout_s=5.0)):
        yield {s.name: s.url for s in specs}
