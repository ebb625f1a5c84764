"""How requests are scheduled: the Conductor (`ConductorConfig`, the `[conductor]` table of
`Config` and of the router's file), the linear cost model it estimates with (`LinearCostConfig`,
the router's `[router.cost]` table) and the cluster the simulator replays traces through
(`SimConfig`).

The Conductor has two uses, each with its own complete defaults, named here and nowhere else:

    SIMULATOR_CONDUCTOR   the paper's set-up: 512-token blocks of the traces, a 10 s decode-stage
                          prior (tsukimi/sim/*, `tsukimi sim`, the `[conductor]` table of `Config`)
    ROUTER_CONDUCTOR      the live router (`tsukimi router`, a `Router` built in code): the
                          workers' 16-token blocks, the decode stage from the cost model

`ConductorConfig` itself has no defaults: every caller starts from one of the two
(`dataclasses.replace(ROUTER_CONDUCTOR, rejection="none")`), so no code path gets the other
use's prior by accident (a `Router` built in code once got the simulator's; commit 1095f22).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from tsukimi.config.loader import require
from tsukimi.errors import ConfigError

RejectionName = Literal["none", "baseline", "early", "predicted", "predicted_uniform"]
REJECTION_NAMES: tuple[str, ...] = get_args(RejectionName)
ReservationName = Literal["oracle", "max_tokens", "mean", "p90"]
RESERVATION_NAMES: tuple[str, ...] = get_args(ReservationName)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConductorConfig:
    """The Conductor (tsukimi/scheduler/conductor.py). No defaults: start from
    `SIMULATOR_CONDUCTOR` or `ROUTER_CONDUCTOR` (see the module).

    block_tokens: tokens per KV block (the traces' 512; the router asks its workers and uses
        this only when none reports one).
    ttft_slo_s / tbt_slo_s: the service-level objectives a placement must meet.
    rejection: "none" admits everything; "baseline" checks TTFT at arrival and the decode
        load only when prefill is done (a request rejected then wasted its prefill); "early"
        also checks the current decode load at arrival; "predicted" checks the decode load
        predicted for when the request would reach decode (each request weighted by the
        observed distribution of decode-stage lengths); "predicted_uniform" is the paper's
        system-level prediction as written: every decode stage lasts the mean observed one,
        and the average TBT ratio over all decode instances is tested.
    recheck_decode: with "early" and the predicted modes, the decode load is checked again
        when prefill is done, and a request that no longer fits is rejected then (its prefill
        wasted); False: a request admitted at arrival always goes on to decode, however loaded
        (the paper's reading of early rejection; decode may then run over the TBT SLO).
    reuse: "global": a prefill instance may fetch a longer prefix from any other cache (the
        pool); "local": only its own cache counts (the per-instance baseline).
    balancing_threshold: a prefill instance fetches a longer prefix from elsewhere only when
        it is at least this many times its local match (else it recomputes the difference);
        a fetched prefix stays in its cache (hot-spot replication).
    prefill_chunk_tokens: prefill instances compute at most this many tokens per iteration.
    kv_bandwidth_bytes_s: KV transfer bandwidth between instances and the pool.
    decode_estimate_s: a request's decode stage length assumed before any has finished (then
        the distribution of the observed ones is used); 0: its expected output at the decode
        instance's predicted TBT (the cost model's; what `tsukimi router` uses: a fixed prior
        fitted to one model misjudges another's cold start).
    ssd_read_bytes_s: read bandwidth of an instance's SSD tier (KV found only on SSD costs
        this to load, and the network bandwidth as well when it is another instance's).
    kv_wait: with "early" and the predicted modes, a request whose decode placement lacks KV
        memory or would break the TBT SLO waits, in one queue in arrival order, when its
        predicted TTFT, the wait included, meets the TTFT SLO (queue, then reject;
        tsukimi/scheduler/admission.py); with `recheck_decode`, a prefilled request whose decode
        batch is too large now waits for a place in it the same way (callers that can hold it
        pass `admit_decode(..., wait=True)`: the router, the simulator); False: it is rejected
        at once (the paper's policies, which the simulator's overload experiments reproduce).
    """

    block_tokens: int
    ttft_slo_s: float
    tbt_slo_s: float
    rejection: RejectionName
    recheck_decode: bool
    reuse: Literal["global", "local"]
    balancing_threshold: float
    prefill_chunk_tokens: int
    kv_bandwidth_bytes_s: float
    decode_estimate_s: float
    ssd_read_bytes_s: float
    kv_wait: bool

    def __post_init__(self) -> None:
        require(
            self.rejection in REJECTION_NAMES,
            f"conductor.rejection must be one of {', '.join(REJECTION_NAMES)}, got {self.rejection!r}",
        )
        require(self.block_tokens > 0, "conductor.block_tokens must be > 0")
        for name in ("ttft_slo_s", "tbt_slo_s", "kv_bandwidth_bytes_s", "ssd_read_bytes_s"):
            require(getattr(self, name) > 0, f"conductor.{name} must be > 0")
        require(self.decode_estimate_s >= 0, "conductor.decode_estimate_s must be >= 0 (0: from the cost model)")
        require(self.reuse in ("global", "local"), f"conductor.reuse must be global or local, got {self.reuse!r}")
        require(self.balancing_threshold >= 1, "conductor.balancing_threshold must be >= 1")
        require(self.prefill_chunk_tokens > 0, "conductor.prefill_chunk_tokens must be > 0")


SIMULATOR_CONDUCTOR = ConductorConfig(
    block_tokens=512,
    ttft_slo_s=30.0,
    tbt_slo_s=0.1,
    rejection="predicted",
    recheck_decode=True,
    reuse="global",
    balancing_threshold=1.0,
    prefill_chunk_tokens=8192,
    kv_bandwidth_bytes_s=100e9,
    decode_estimate_s=10.0,
    ssd_read_bytes_s=8e9,
    kv_wait=True,
)
"""The simulator's Conductor: the paper's set-up (LLaMA2-70B on 8xA800 instances, the traces'
512-token blocks), a 10 s decode-stage prior until stages are observed."""

ROUTER_CONDUCTOR = ConductorConfig(
    block_tokens=16,
    ttft_slo_s=30.0,
    tbt_slo_s=0.1,
    rejection="predicted",
    recheck_decode=True,
    reuse="global",
    balancing_threshold=1.0,
    prefill_chunk_tokens=8192,
    kv_bandwidth_bytes_s=100e9,
    decode_estimate_s=0.0,
    ssd_read_bytes_s=8e9,
    kv_wait=True,
)
"""The live router's Conductor: no fixed decode-stage prior (a request's expected output at the
decode instance's predicted TBT: a prior fitted to one model misjudges another's cold start);
block_tokens only when no worker reports its own (the workers' default, `WorkerConfig`)."""


@dataclass(frozen=True, slots=True)
class LinearCostConfig:
    """A `LinearCostModel`'s coefficients (tsukimi/scheduler/cost_model.py), in seconds:
    prefill = prefill_base_s + prefill_token_s x new tokens + prefill_pair_s x attention pairs;
    decode step = decode_step_s + decode_request_s x batch + decode_context_token_s x context
    tokens; kv_bytes_per_token: the KV of one token. The router's `[router.cost]` table (what
    the Conductor estimates with under `router.cost_model = "config"`, and for any part no
    worker profiles); the defaults suit SmolLM2 on this CPU (0.5 ms per prompt token, 20 ms per
    decode step)."""

    prefill_base_s: float = 0.005
    prefill_token_s: float = 0.0005
    prefill_pair_s: float = 0.0
    decode_step_s: float = 0.02
    decode_request_s: float = 0.0
    decode_context_token_s: float = 0.0
    kv_bytes_per_token: int = 2048

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, positive = getattr(self, f.name), f.name == "kv_bytes_per_token"
            require(
                value > 0 if positive else value >= 0, f"{f.name} must be {'> 0' if positive else '>= 0'}, got {value}"
            )


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The simulated cluster (tsukimi/sim/simulator.py).

    speed: the trace is replayed this many times faster than recorded.
    cache_blocks: each instance's DRAM cache, in blocks (None: unbounded).
    ssd_blocks: each prefill instance's SSD tier, in blocks, below its DRAM cache (blocks
        evicted from DRAM go there; 0: no SSD tier).
    colocated_chunk_tokens: the colocated baseline's chunked-prefill budget per step.
    reservation: the KV a decode instance reserves for a request's output
        (tsukimi/sim/reservation.py): "oracle" (the real length), "max_tokens"
        (`max_output_tokens`), "mean" or "p90" of the observed output lengths.
    decode_kv_tokens: each decode instance's KV memory in tokens (0: what the cost model's node
        holds beside the weights; unbounded for a cost model without one).
    """

    shape: Literal["pd", "colocated"] = "pd"
    num_prefill: int = 8
    num_decode: int = 8
    num_colocated: int = 16
    router: Literal["round_robin", "least_load"] = "least_load"
    speed: float = 1.0
    policy: str = "lru"
    cache_blocks: int | None = 6000
    colocated_chunk_tokens: int = 2048
    sample_every_s: float = 10.0
    ssd_blocks: int = 0
    reservation: ReservationName = "p90"
    max_output_tokens: int = 2048
    decode_kv_tokens: int = 0

    def __post_init__(self) -> None:
        require(self.decode_kv_tokens >= 0, "decode_kv_tokens must be >= 0 (0: the cost model's)")
        if self.shape not in ("pd", "colocated") or self.router not in ("round_robin", "least_load"):
            raise ConfigError("shape must be pd or colocated; router round_robin or least_load")
        if min(self.num_prefill, self.num_decode, self.num_colocated) < 1 or self.speed <= 0:
            raise ConfigError("instance counts must be >= 1 and speed > 0")
        if self.cache_blocks is not None and self.cache_blocks < 1:
            raise ConfigError("cache_blocks must be >= 1 (or None for unbounded)")
        if self.colocated_chunk_tokens < 1 or self.sample_every_s <= 0:
            raise ConfigError("colocated_chunk_tokens must be >= 1 and sample_every_s > 0")
        if self.reservation not in RESERVATION_NAMES or self.max_output_tokens < 1 or self.ssd_blocks < 0:
            raise ConfigError(
                f"reservation must be one of {', '.join(RESERVATION_NAMES)}, max_output_tokens >= 1, ssd_blocks >= 0"
            )
