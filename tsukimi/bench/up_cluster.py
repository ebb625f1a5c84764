"""The `tsukimi up` cluster a bench runs against: up.py's own `plan` of a `ClusterConfig` given
as `--set` settings, launched by the cluster launcher (tsukimi/serving/cluster/launcher.py) in
this process, with `tsukimi up`'s restart policy (`tending`), logging under the bench's
working directory.

    settings = serving_settings("tiny", "pd", prefix_caching=True, num_blocks=4096)
    with launch_up(settings, workdir) as cluster, cluster.tending():
        ... cluster.api, cluster.master, cluster.processes ...

`serve` and `overload` run on it as it is; `kv-burst` takes the plan (`planned`) and adjusts it
first (its decode worker's KV size; a router of its own per burst).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tsukimi.config import ClusterConfig, load
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.serving.cluster.up import plan

Groups = list[list[ProcessSpec]]
SEGMENT_BYTES = 512 << 20  # NOTE: each PD worker's share of the pool, as the serving benches always gave


def serving_settings(
    model: str, mode: str, *, prefix_caching: bool = True, num_blocks: int = 4096, extra: Sequence[str] = ()
) -> list[str]:
    """The `--set` settings of a bench's cluster (pure): the model and mode, KV reuse on or off,
    each worker's KV cache in blocks, a free API port, then `extra` (`workers.prefill=2`,
    `master.hot_threshold=5`), which win."""
    return [
        f'model="{model}"',
        f'mode="{mode}"',
        f"workers.prefix_caching={'true' if prefix_caching else 'false'}",
        f"workers.num_blocks={num_blocks}",
        f"workers.segment_bytes={SEGMENT_BYTES}",
        "router.port=0",
        *extra,
    ]


def planned(settings: Sequence[str], workdir: Path) -> tuple[Groups, LaunchConfig]:
    """`tsukimi up`'s plan of `settings` and how to launch it (logs under `workdir`/logs, the
    cluster's timeouts and restart policy). Creates the log directory.

    Raises:
        ConfigError: bad settings.
    """
    config = load(ClusterConfig, None, list(settings))
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    launch = LaunchConfig(logs, config.startup_timeout_s, config.stop_timeout_s, verbose=1, restart=config.restart)
    return plan(config, data_dir=workdir), launch


def launch_up(settings: Sequence[str], workdir: Path) -> LaunchedCluster:
    """The cluster of `settings` (not started: use it as a context manager; see `planned`).

    Raises:
        ConfigError: bad settings.
    """
    return LaunchedCluster(*planned(settings, workdir))
