"""A request inside the engine: `EngineRequest`, the per-request record that the scheduler,
the block manager and the model runner share, and `StepOutput`, what one step yields for it.

A request's tokens are its prompt then its output so far; its KV (`SequenceKV`) covers the
first `seq.num_tokens` of them, and `hashes` chains the full blocks among those (the chain
that the local prefix cache and the KV pool know them by)::

    tokens:     | prompt ......................................... | output ....... |
    KV:         |<-------------- seq.num_tokens -------------->|  (rest: computed later)
    blocks:     | block 0 | block 1 | block 2 | partial        |
    hashes:       h0        h1        h2                          (full blocks only)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tsukimi.engine.kv_cache import SequenceKV
from tsukimi.engine.sampling import SamplingParams
from tsukimi.scheduler.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class StepOutput:
    """The tokens that one step produced for one request (the engine's output)."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None while generating; "stop", "length" or "abort"
    cached_tokens: int = 0  # prompt tokens whose KV was reused (local cache or pool)
    pool_tokens: int = 0  # of those, loaded from the pool


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One request's state in the engine (mutable; compared by identity).

    `seq` holds blocks only while the request is admitted (running, or being scheduled): a
    waiting request holds none. `cached_tokens` / `pool_tokens` are set at each admission.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    seq: SequenceKV = field(default_factory=SequenceKV)
    output: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # of the full blocks whose KV is in the cache
    admitted: bool = False
    cached_tokens: int = 0
    pool_tokens: int = 0

    @property
    def tokens(self) -> list[int]:
        """The prompt, then the output so far (a new list)."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """len(tokens): prompt and output (of which `seq.num_tokens` have KV)."""
        return len(self.prompt) + len(self.output)
