"""`tsukimi up`'s CPP prefill groups: `[workers] cpp_groups = N` starts N groups of
`cpp_stages` `tsukimi prefill-stage` processes beside the ordinary workers (mode "pd").

    cpp-0           stage 0 (the head): a prefill worker to the router, role "prefill"
      -> cpp-0-s1   stage 1 ... -> cpp-0-s{k-1}   role "cpp-stage", linked HOST:PORT

Every stage joins the KV pool (the master) with the workers' segment_bytes and shares their
block_tokens, num_blocks, threads and dtype; the chunk is `cpp_chunk_tokens`. The stages
start together with the workers: a stage retries its downstream link for its
connect_timeout_s, so the head answers /health only once the whole group is linked, and the
later stages (no HTTP) count as ready at once. The supervisor watches and stops them like
every other child. The router learns from the head's /health that it is a group
(tsukimi/serving/router/cpp_groups.py).
"""

from __future__ import annotations

from collections.abc import Callable

from tsukimi.config import ClusterConfig
from tsukimi.config.pipeline import PrefillStageConfig
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.serving.prefill_group.commands import stage_args

STAGE_ROLE = "cpp-stage"  # a later stage: a child of `tsukimi up`, not a worker of the router


def stage_configs(config: ClusterConfig, master: str, port: Callable[[int], int]) -> list[PrefillStageConfig]:
    """Every stage of every group, each group's head first (pure but for `port`).

    Args:
        config: the cluster (`workers.cpp_groups`, `cpp_stages`, `cpp_chunk_tokens`).
        master: the store master, tcp://HOST:PORT.
        port: the port of the i-th stage process (counting over all groups).
    """
    w, shared = config.workers, config.workers.worker
    stages: list[PrefillStageConfig] = []
    for g in range(w.cpp_groups):
        ports = [port(len(stages) + s) for s in range(w.cpp_stages)]
        host = f"[{config.host}]" if ":" in config.host else config.host
        for s in range(w.cpp_stages):
            downstream = f"{host}:{ports[s + 1]}" if s + 1 < w.cpp_stages else ""
            stages.append(
                PrefillStageConfig(
                    name=f"cpp-{g}" if s == 0 else f"cpp-{g}-s{s}",
                    stage=s,
                    num_stages=w.cpp_stages,
                    model=config.model,
                    dtype="float32" if shared.dtype == "auto" else shared.dtype,  # NOTE: CPP stages run on CPU
                    host=config.host,
                    port=ports[s],
                    downstream=downstream,
                    master=master,
                    segment_bytes=shared.segment_bytes,
                    block_tokens=shared.block_tokens,
                    num_blocks=shared.num_blocks or 512,  # NOTE: 0 = sized from memory, which a stage does not do
                    chunk_tokens=w.cpp_chunk_tokens,
                    threads=shared.threads,
                )
            )
    return stages


def group_processes(config: ClusterConfig, master: str, port: Callable[[int], int]) -> list[ProcessSpec]:
    """The processes of `stage_configs`: a head is a prefill worker (HTTP, healthy on
    /health), a later stage a `STAGE_ROLE` child addressed HOST:PORT (pure but for `port`)."""
    host = f"[{config.host}]" if ":" in config.host else config.host
    return [
        ProcessSpec(c.name, "prefill", stage_args(c), f"http://{host}:{c.port}")
        if c.stage == 0
        else ProcessSpec(c.name, STAGE_ROLE, stage_args(c), f"{host}:{c.port}", health="none")
        for c in stage_configs(config, master, port)
    ]
