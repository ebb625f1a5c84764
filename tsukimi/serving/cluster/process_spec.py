"""What `tsukimi up` starts: one child process, as its supervisor (tsukimi/serving/cluster/up.py)
and the planners (up.py's `plan`, cpp_plan.py, tsukimi/integrations/vllm/launch.py)
describe it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One child: its name, role, `tsukimi` arguments and HTTP base URL. `argv`: a command
    line that is not tsukimi's (then `args` is unused), `env`: variables added to ours;
    `health`: "tsukimi" waits for {"status": "ok"} on /health, "http" for any 200 (vLLM),
    "none" for nothing (a CPP group's later stage: its head's health covers it); `nice`: added to
    our nice value for the process, as `nice -n` (at most 19; an engine's: `workers.nice`)."""

    name: str
    role: str
    args: tuple[str, ...]
    url: str
    argv: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    health: Literal["tsukimi", "http", "none"] = "tsukimi"
    nice: int = 0
