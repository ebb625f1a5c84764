"""The `tsukimi up` cluster a bench runs against: up.py's own `plan` of a `ClusterConfig` given
as `--set` settings, launched by the cluster launcher (tsukimi/serving/cluster/launcher.py) in
this process, with `tsukimi up`'s restart policy (`tending`), logging under the bench's
working directory.

    settings = serving_settings("tiny", "pd", prefix_caching=True, num_blocks=4096)
    with launch_up(settings, workdir) as cluster, cluster.tending():
        ... cluster.api, cluster.master, cluster.processes ...

`serve` and `overload` run on it as it is; `kv-burst` adjusts the plan first (its router's
settings, its decode worker's KV size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def launch_up(
    settings: Sequence[str], workdir: Path, adjust: Callable[[Groups], Groups] | None = None
) -> LaunchedCluster:
    """The cluster of `settings` (not started: use it as a context manager), its logs under
    `workdir`/logs; `adjust` may change the plan first (pure function of the groups).

    Raises:
        ConfigError: bad settings.
    """
    config = load(ClusterConfig, None, list(settings))
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    groups = plan(config, data_dir=workdir)
    launch = LaunchConfig(logs, config.startup_timeout_s, config.stop_timeout_s, verbose=1, restart=config.restart)
    return LaunchedCluster(adjust(groups) if adjust else groups, launch)
