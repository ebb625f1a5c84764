"""The router's side of CPP prefill groups (tsukimi/serving/prefill_group/stage.py): which prefill
workers are groups, and which requests they may take.

    GET /health of a group's head -> Health.cpp (stages, chunk_tokens, hop costs)
        -> WorkerHandle.cpp -> `conductor_groups` -> Conductor(groups=...): the Conductor
           prices the group with the pipeline estimate (tsukimi/scheduler/cpp.py), queue
           included, so long prompts go to the group and short ones to ordinary workers.

A group computes an argmax: it refuses sampling (temperature > 0) with 400. `excluded`
keeps such requests off the groups, and names the problem when only groups could take them.
A group runs one prompt at a time; the Conductor already books every prefill instance as one
queue, so nothing more is needed for that. A worker learns it is a group at discovery only:
a head silent then is priced as an ordinary worker until the router restarts.

Pure functions over the router's handles.
"""

from __future__ import annotations

from collections.abc import Iterable

from tsukimi.errors import InvalidArgument
from tsukimi.scheduler.cpp import CppGroup
from tsukimi.serving.protocol import GenerateRequest
from tsukimi.serving.router.workers import WorkerHandle


def conductor_groups(workers: Iterable[WorkerHandle]) -> dict[str, CppGroup]:
    """The prefill workers that reported a CPP group, as the Conductor's `groups` (pure)."""
    return {
        w.spec.name: CppGroup(w.cpp.stages, w.cpp.hop_s_per_token, w.cpp.hop_latency_s, w.cpp.chunk_tokens)
        for w in workers
        if w.spec.role == "prefill" and w.cpp is not None
    }


def excluded(workers: Iterable[WorkerHandle], request: GenerateRequest) -> set[str]:
    """The workers the Conductor must not place `request` on: those marked down and, when it
    samples, the CPP groups (pure).

    Raises:
        InvalidArgument: the request samples and every prefill worker is a CPP group.
    """
    handles = list(workers)
    out = {w.spec.name for w in handles if not w.healthy}
    if request.temperature > 0:
        groups = {w.spec.name for w in handles if w.spec.role == "prefill" and w.cpp is not None}
        if groups and all(w.cpp is not None for w in handles if w.spec.role == "prefill"):
            raise InvalidArgument(
                "sampling (temperature > 0) needs an ordinary prefill worker: this cluster's prefill workers "
                f"({', '.join(sorted(groups))}) are CPP groups, which serve greedy requests only"
            )
        out |= groups
    return out
