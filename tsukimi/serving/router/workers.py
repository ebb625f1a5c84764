"""What the router places requests on: a worker as declared (`WorkerSpec`, parsed from
"NAME=ROLE@URL,..."), as the router sees it (`WorkerHandle`: health, load, what it reported)
and as it shows it (`WorkerStatus`). Shared by every backend (tsukimi workers, vLLM
instances: tsukimi/serving/router/backend.py).

Runs on one asyncio event loop (the handles are plain mutable records).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tsukimi.errors import ConfigError
from tsukimi.serving.kv_events import EventSource
from tsukimi.serving.protocol import ROLES, CostProfile, CppHealth, Load, Role

POOL = "pool"  # the KV pool's instance name in the router's prefix index: no worker may take it


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A worker as declared: its name, role and base URL (http://host:port)."""

    name: str
    role: Role
    url: str

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name == POOL:
            raise ConfigError(f"a worker name must be non-empty, without '/', and not {POOL!r}: {self.name!r}")
        if self.role not in ROLES:
            raise ConfigError(f"worker {self.name}: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"worker {self.name}: the URL must start with http:// or https://, got {self.url!r}")


def parse_workers(text: str) -> list[WorkerSpec]:
    """Parses "NAME=ROLE@URL,..." (e.g. "p0=prefill@http://127.0.0.1:9001"). Pure.

    Raises:
        ConfigError: a malformed item, a bad role or URL, no worker, or a duplicate name.
    """
    specs: list[WorkerSpec] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, rest = item.partition("=")
        role, at, url = rest.partition("@")
        if not (eq and at):
            raise ConfigError(f"a worker must look like NAME=ROLE@URL, got {item!r}")
        specs.append(WorkerSpec(name.strip(), role.strip(), url.strip().rstrip("/")))  # type: ignore[arg-type]
    if not specs:
        raise ConfigError("the router's workers name no worker (NAME=ROLE@URL,...)")
    if len({s.name for s in specs}) != len(specs):
        raise ConfigError(f"duplicate worker names in {text!r}")
    return specs


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A snapshot of one worker for /health and /metrics. requests: how many this router has
    sent there (streams opened); cpp_stages: a CPP prefill group's stages (0: one worker);
    free_blocks / total_blocks: its KV cache blocks as last polled (0: not reported)."""

    name: str
    role: Role
    healthy: bool
    waiting: int
    running: int
    in_flight: int
    requests: int = 0
    cpp_stages: int = 0
    free_blocks: int = 0
    total_blocks: int = 0


@dataclass(slots=True)
class WorkerHandle:
    """The router's view of one worker: health, load and block_tokens as last seen, and the
    requests this router has in flight there and has sent there in all (mutated by the
    polls, tsukimi/serving/router/liveness.py, and the router). `events`: where it publishes KV
    events (None: nowhere, or not yet known); `cpp`: what a CPP prefill group's head reported
    (None: an ordinary worker, or not heard from at discovery); `cost`: its start-up profile
    (None: none reported)."""

    spec: WorkerSpec
    healthy: bool = True
    load: Load = dataclasses.field(default_factory=lambda: Load(0, 0))
    block_tokens: int = 0
    in_flight: int = 0
    events: EventSource | None = None
    requests: int = 0
    cpp: CppHealth | None = None
    misses: int = 0  # polls in a row that timed out
    cost: CostProfile | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def status(self) -> WorkerStatus:
        """The snapshot (pure)."""
        s, stages = self.spec, self.cpp.stages if self.cpp is not None else 0
        load = self.load
        return WorkerStatus(
            s.name,
            s.role,
            self.healthy,
            load.waiting,
            load.running,
            self.in_flight,
            self.requests,
            stages,
            load.free_blocks,
            load.total_blocks,
        )
