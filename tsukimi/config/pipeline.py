"""Chunked pipeline parallelism: one stage process of a prefill group (`PrefillStageConfig`,
`tsukimi prefill-stage`; tsukimi/serving/prefill_group/stage.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tsukimi.config.loader import require
from tsukimi.config.serving import DTYPE_NAMES, DTypeName


@dataclass(frozen=True, slots=True)
class PrefillStageConfig:
    """Stage `stage` of a prefill group of `num_stages` processes.

    port: stage 0 (the head) serves the prefill worker's HTTP API there; a later stage
        listens there for its upstream neighbour's link (0 = ephemeral, printed once ready).
    downstream: HOST:PORT of the next stage's link ("" on the last stage).
    master: the store master (tcp://HOST:PORT) to publish the KV to; "" = no pool (benchmarks).
    chunk_tokens: tokens per pipeline chunk (a one-worker prefill with max_batched_tokens =
        chunk_tokens computes the very same arithmetic).
    threads: torch's intra-op threads (process-wide).
    link_bytes_s / hop_latency_s: what the head tells the router's cost model of one hop
        between stages (tsukimi/scheduler/cpp.py: a token's hidden state over the link, plus a
        fixed cost per chunk and boundary); estimates, not limits (the defaults: loopback TCP).
    connect_timeout_s: how long a stage tries to reach its downstream neighbour;
        request_timeout_s: the longest one prompt may take through the whole group.
    """

    name: str = "cpp-0"
    stage: int = 0
    num_stages: int = 1
    model: str = "tiny"
    dtype: DTypeName = "float32"
    host: str = "127.0.0.1"
    port: int = 0
    downstream: str = ""
    master: str = ""
    segment_bytes: int = 64 << 20
    block_tokens: int = 16
    num_blocks: int = 512
    chunk_tokens: int = 512
    threads: int = 1
    link_bytes_s: float = 1e9
    hop_latency_s: float = 1e-3
    connect_timeout_s: float = 60.0
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        require(self.num_stages >= 1, f"num_stages must be >= 1, got {self.num_stages}")
        require(0 <= self.stage < self.num_stages, f"stage must be in 0..{self.num_stages - 1}, got {self.stage}")
        require(self.dtype in DTYPE_NAMES, f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        require(0 <= self.port <= 65535, f"port must be in 0..65535, got {self.port}")
        last = self.stage == self.num_stages - 1
        require(last == (not self.downstream), "every stage but the last needs downstream HOST:PORT (the last none)")
        require(
            not self.master or self.master.startswith("tcp://"),
            f"master must be tcp://HOST:PORT or '', got {self.master!r}",
        )
        for name in ("block_tokens", "num_blocks", "chunk_tokens", "threads"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        require(self.link_bytes_s > 0 and self.hop_latency_s >= 0, "link_bytes_s must be > 0, hop_latency_s >= 0")
        require(self.connect_timeout_s > 0 and self.request_timeout_s > 0, "timeouts must be > 0")
