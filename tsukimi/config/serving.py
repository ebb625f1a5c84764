"""Serving: one inference worker (`WorkerConfig`, `tsukimi worker`), the router (`RouterAppConfig`,
everything `tsukimi router` runs and the file its `--config` reads: `[router]` placement,
`[conductor]`, `[vllm]` for vLLM instances) and a whole local cluster (`ClusterConfig`, the
file `tsukimi up --config` reads), with the worker roles and dtypes they name.

`[workers]` of a cluster file lists the counts per role and, flat beside them, the settings
every worker shares: they build `ClusterWorkersConfig.worker`, a `WorkerConfig` that
`tsukimi up` copies per worker with that worker's name, role, port and master.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

from tsukimi.config.loader import INLINE_KEYS, require
from tsukimi.config.memory import MemoryBudget
from tsukimi.config.scheduling import ROUTER_CONDUCTOR, ConductorConfig, LinearCostConfig
from tsukimi.config.store import MasterConfig
from tsukimi.errors import ConfigError

Role = Literal["colocated", "prefill", "decode"]
ROLES: tuple[str, ...] = get_args(Role)
DTypeName = Literal["float32", "bfloat16", "float16"]
DTYPE_NAMES: tuple[str, ...] = get_args(DTypeName)
# NOTE: what a worker may ask for: "auto" is resolved on the machine (tsukimi/engine/device.py)
WorkerDTypeName = Literal["auto", "float32", "bfloat16", "float16"]
WORKER_DTYPE_NAMES: tuple[str, ...] = get_args(WorkerDTypeName)
DeviceName = Literal["auto", "cpu", "cuda"]
DEVICE_NAMES: tuple[str, ...] = get_args(DeviceName)
ClusterMode = Literal["pd", "colocated"]
# NOTE: what `[master]` of a cluster file may set of the master's `MasterConfig` (besides its ports)
SHARED_MASTER_KEYS = ("hot_threshold", "hot_max_replicas", "hot_window_s", "hot_cool_ratio", "hot_cool_down_s")
# NOTE: what `[workers]` may set of each worker's `WorkerConfig`; the cluster sets the rest
SHARED_WORKER_KEYS = (
    "block_tokens",
    "num_blocks",
    "kv_cache_memory",
    "max_batched_tokens",
    "segment_bytes",
    "threads",
    "device",
    "dtype",
    "prefix_caching",
    "layerwise_loading",
    "profile_on_start",
)
CostModelSource = Literal["workers", "config"]
PolicyName = Literal["auto", "conductor", "least_load", "round_robin"]
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)
BackendKind = Literal["tsukimi", "vllm"]
BACKEND_KINDS: tuple[str, ...] = get_args(BackendKind)
VllmHashAlgo = Literal["sha256", "sha256_cbor"]
VLLM_HASH_ALGOS: tuple[str, ...] = get_args(VllmHashAlgo)


def _dotted(name: str) -> bool:
    """Whether `name` is a dotted Python name ("a.b_c.D")."""
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _check_port(port: int, where: str) -> None:
    require(0 <= port <= 65535, f"{where} must be in 0..65535 (0 = a free port), got {port}")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker. port 0 = ephemeral. master (tcp://HOST:PORT, or etcd://HOST:PORT[,...] to
    follow HA masters' leader) and segment_bytes (memory this
    worker contributes to the KV pool) matter for the prefill and decode roles only. threads:
    torch's intra-op threads (process-wide). metadata_url: the metadata service
    (http://HOST:PORT/metadata, etcd://...) of the P2P store that live weight updates pull
    from (`POST /admin/update_weights`); "" = none (`tsukimi up` starts one).

    kv_cache_memory: the memory of the worker's KV cache, as vLLM's KV cache space: bytes
    ("512MiB", "1G") or a fraction of the memory available when the worker starts ("0.1");
    the blocks are this over the model's bytes per block (layers x KV heads x head dim x dtype
    x 2 x block_tokens; tsukimi/engine/kv_budget.py). The default, 512 MiB, suits CPU serving on
    a small machine where several workers share one host: it holds 8k tokens of SmolLM2-135M in
    float32 (~2x in bfloat16) and 256k of the tiny test model; the memory is committed only as
    blocks are used. num_blocks > 0 overrides it with an explicit block count.

    profile_on_start: before it reports healthy, time a few prefills and decode steps of its own
    engine and fit the Conductor's cost model to them (tsukimi/engine/profile.py; about 1 s for
    tiny, a few for SmolLM2), reported in GET /health for the router.

    engine_factory: "MODULE:CALLABLE" that builds the worker's engines with `LLMEngine`'s
    arguments ("" = `LLMEngine`; tsukimi/serving/worker/engine_factory.py), e.g. a test's
    engine that fails on purpose; imported when the worker starts.
    """

    name: str = "worker-0"
    role: Role = "colocated"
    model: str = "smollm2"
    host: str = "127.0.0.1"
    port: int = 0
    block_tokens: int = 16
    num_blocks: int = 0
    kv_cache_memory: str = "512MiB"
    max_batched_tokens: int = 512
    master: str = ""
    segment_bytes: int = 256 << 20
    threads: int = 1
    device: str = "auto"  # auto, cpu, cuda or cuda:N (DeviceName; auto: cuda when torch sees a GPU)
    dtype: WorkerDTypeName = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    prefix_caching: bool = True  # False: compute every prompt in full (the no-reuse baseline)
    metadata_url: str = ""
    layerwise_loading: bool = False  # read pooled KV layer by layer, overlapped with the forward
    profile_on_start: bool = True
    engine_factory: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"worker role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.dtype not in WORKER_DTYPE_NAMES:
            raise ConfigError(f"worker dtype must be one of {', '.join(WORKER_DTYPE_NAMES)}, got {self.dtype!r}")
        kind, _, index = self.device.partition(":")
        if kind not in DEVICE_NAMES or (index and not (kind == "cuda" and index.isdigit())):
            raise ConfigError(f"worker device must be one of {', '.join(DEVICE_NAMES)} or cuda:N, got {self.device!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"worker port must be in 0..65535, got {self.port}")
        for name, low in (
            ("block_tokens", 1),
            ("num_blocks", 0),
            ("max_batched_tokens", 1),
            ("threads", 1),
            ("segment_bytes", 0),
        ):
            if getattr(self, name) < low:
                raise ConfigError(f"worker {name} must be >= {low}, got {getattr(self, name)}")
        MemoryBudget.parse(self.kv_cache_memory)  # NOTE: raises ConfigError when malformed
        module, colon, name = self.engine_factory.partition(":")
        if self.engine_factory and not (colon and _dotted(module) and _dotted(name)):
            raise ConfigError(
                f"worker engine_factory must be MODULE:CALLABLE (e.g. tsukimi.engine.engine:LLMEngine), "
                f"got {self.engine_factory!r}"
            )
        if self.metadata_url and not self.metadata_url.startswith(("http://", "etcd://", "memory://")):
            raise ConfigError(
                f"worker metadata_url must be http://..., etcd://... or memory://NAME (tests), "
                f"got {self.metadata_url!r}"
            )
        if self.role != "colocated" and not self.master.startswith(("tcp://", "etcd://")):
            raise ConfigError(
                f"a {self.role} worker needs the store master as tcp://HOST:PORT or "
                f"etcd://HOST:PORT[,...], got {self.master!r}"
            )


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The router's placement (`[router]` in the TOML file).

    mode: "auto" (colocated when every worker is colocated, pd when they are prefill and
        decode workers), "colocated" or "pd".
    policy: who places the requests. "conductor": the Conductor (tsukimi/scheduler/conductor.py:
        the prefix index, the SLOs, KV memory); "least_load" / "round_robin": the baselines
        (tsukimi/scheduler/baselines.py; in pd mode the prefill and the decode worker are each
        picked so). "auto": the Conductor in pd mode; in colocated mode least_load over
        tsukimi workers and the Conductor over vLLM instances (their KV events feed its index).
    block_tokens: 0 = ask the workers (/health). decode_capacity_tokens: the KV tokens of every
        decode instance; 0 = each decode worker's own (its /load total_blocks x block_tokens).
    max_waiting_requests: 429 "queue_full" when every worker that could take a new prompt has
        more than this waiting (polled) or in flight from this router (0: no limit).
    cost_model: where the Conductor's cost model comes from: "workers" (the default): the
        coefficients the prefill (and decode) workers fitted to themselves at start-up
        (GET /health), scaled by the slowdowns they measure online (GET /load); a worker that
        reports none falls back to `cost`, with a warning. "config": `cost` alone.
    cost: the `[router.cost]` table, a `LinearCostConfig` (tsukimi/serving/router/worker_costs.py
        builds the model from it).
    overhead_probe: in pd mode over tsukimi workers, at start-up one short prompt (a block, one
        token) through a prefill worker measures what a request spends outside the engine steps the cost model
        prices (hops, the pool publish): the Conductor's per-request TTFT term until the
        prefills' own ends teach it (tsukimi/scheduler/service_term.py).
    prefill_concurrency: with the Conductor in pd mode over tsukimi workers, at most this many
        prompts in flight to each prefill worker, sent in the order they were booked (0: no
        limit; vLLM instances are never limited: they batch what they get): the Conductor
        prices a prefill queue served in order, which a worker handed a whole burst at once does
        not keep.
    """

    mode: Literal["auto", "colocated", "pd"] = "auto"
    policy: PolicyName = "auto"
    poll_interval_s: float = 0.5
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 60.0
    startup_timeout_s: float = 10.0
    block_tokens: int = 0
    decode_capacity_tokens: int = 0
    max_waiting_requests: int = 0
    cost_model: CostModelSource = "workers"
    cost: LinearCostConfig = field(default_factory=LinearCostConfig)
    overhead_probe: bool = True
    prefill_concurrency: int = 2

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "colocated", "pd") or self.policy not in POLICY_NAMES:
            raise ConfigError(
                f"router.mode must be auto, colocated or pd and router.policy one of {', '.join(POLICY_NAMES)}, "
                f"got {self.mode!r} and {self.policy!r}"
            )
        require(
            self.cost_model in ("workers", "config"),
            f"router.cost_model must be workers or config, got {self.cost_model!r}",
        )
        for f in dataclasses.fields(self):
            value, positive = getattr(self, f.name), f.name.endswith(("timeout_s", "interval_s"))
            if isinstance(value, (int, float)) and (value <= 0 if positive else value < 0):
                raise ConfigError(f"router.{f.name} must be {'> 0' if positive else '>= 0'}, got {value}")


@dataclass(frozen=True, slots=True)
class VllmBackendConfig:
    """vLLM API servers as the router's workers (`[vllm]`, `tsukimi router --backend vllm`;
    tsukimi/integrations/vllm/backend.py).

    block_size / hash_algo: how the instances hash their blocks (`--block-size`,
        `--prefix-caching-hash-algo`): the router's keys must be theirs.
    kv_events: "NAME=ENDPOINT[+REPLAY_ENDPOINT],..." per instance (tcp:// or ipc://), on
        `kv_events_topic`; an instance named nowhere feeds the prefix index nothing.
    pool: the instances share tsukimi's KV pool (TsukimiConnector saves every full block there).
    read_timeout_s: how long a call to an instance may wait for its next bytes (`[router]
        read_timeout_s` is the tsukimi workers'): a CPU vLLM's queued prefill may take minutes.
    """

    block_size: int = 128
    hash_algo: VllmHashAlgo = "sha256"
    kv_events: str = ""
    kv_events_topic: str = "kv"
    pool: bool = False
    read_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        require(self.block_size > 0, f"vllm.block_size must be > 0, got {self.block_size}")
        require(self.read_timeout_s > 0, f"vllm.read_timeout_s must be > 0, got {self.read_timeout_s}")
        require(
            self.hash_algo in VLLM_HASH_ALGOS,
            f"vllm.hash_algo must be one of {', '.join(VLLM_HASH_ALGOS)}, got {self.hash_algo!r}",
        )


@dataclass(frozen=True, slots=True)
class RouterAppConfig:
    """Everything `tsukimi router` runs (`build_router_app`, tsukimi/serving/router/app.py): the
    file `tsukimi router --config` reads, its flags mapped onto these keys.

    workers: "NAME=ROLE@URL,..." (ROLE colocated, prefill or decode). backend: what they are,
        "tsukimi" workers or "vllm" API servers (`[vllm]`).
    model: the model spec whose tokenizer the router loads (tiny, smollm2, PATH.gguf, a Hugging
        Face folder: a vLLM model's folder for the vllm backend); served_model_name: the id
        /v1/models lists ("" = `model`).
    master / master_http: the store master, for the dashboard's store view ("" = none).
    shed_lag_ms: answer new completions 429 "overloaded" while the router's event loop lags
        more than this on average (0: never; tsukimi/serving/router/load_shedding.py).
    health_port: a port of its own for /health and /metrics, answered by a process beside the
        router from what its loop publishes, so that they answer under overload (0: none;
        tsukimi/serving/router/health_port.py).
    """

    workers: str = ""
    backend: BackendKind = "tsukimi"
    model: str = "tiny"
    served_model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    master: str = ""
    master_http: str = ""
    shed_lag_ms: float = 250.0
    health_port: int = 0
    router: RouterConfig = field(default_factory=RouterConfig)
    conductor: ConductorConfig = field(default_factory=lambda: ROUTER_CONDUCTOR)
    vllm: VllmBackendConfig = field(default_factory=VllmBackendConfig)

    def __post_init__(self) -> None:
        require(
            self.backend in BACKEND_KINDS,
            f"backend must be one of {', '.join(BACKEND_KINDS)}, got {self.backend!r}",
        )
        require(self.shed_lag_ms >= 0, f"shed_lag_ms must be >= 0 (0: never shed), got {self.shed_lag_ms}")
        _check_port(self.port, "port")
        _check_port(self.health_port, "health_port")


@dataclass(frozen=True, slots=True)
class ClusterMasterConfig:
    """The store master's ports (0 = a free port) and, flat beside them, its hot-key replication
    settings (SHARED_MASTER_KEYS: `hot_threshold = 5.0` turns it on; `store`, a `MasterConfig`).

    ha: 0 runs one master; N >= 2 runs etcd (Debian's etcd-server, on `etcd_port`) and N masters
    electing their leader through it (`master.ha_etcd`), the workers following the leader
    (etcd://): a master's death costs a failover, not the cluster. rpc_port and http_port are
    then the first master's (the others take free ports)."""

    rpc_port: int = 0
    http_port: int = 0
    ha: int = 0
    etcd_port: int = 0
    store: MasterConfig = field(default_factory=MasterConfig, metadata={INLINE_KEYS: SHARED_MASTER_KEYS})

    def settings(self) -> tuple[str, ...]:
        """`master.KEY=VALUE` for each of SHARED_MASTER_KEYS (what `tsukimi up` passes on)."""
        return tuple(f"master.{key}={getattr(self.store, key)!r}" for key in SHARED_MASTER_KEYS)

    def __post_init__(self) -> None:
        _check_port(self.rpc_port, "master.rpc_port")
        _check_port(self.http_port, "master.http_port")
        _check_port(self.etcd_port, "master.etcd_port")
        require(self.ha == 0 or 2 <= self.ha <= 9, f"master.ha must be 0 (one master) or 2..9, got {self.ha}")


@dataclass(frozen=True, slots=True)
class ClusterWorkersConfig:
    """How many workers of each role (mode "pd" starts prefill + decode, "colocated" the
    colocated ones); base_port 0 = free ports, else consecutive ports from there.

    worker: the settings every worker shares, written flat in `[workers]` (SHARED_WORKER_KEYS:
        `num_blocks = 64`, not a table); its name, role, model, host, port and master are set
        per worker by `tsukimi up`. segment_bytes: memory each PD worker gives the KV pool.
    cpp_groups: CPP prefill groups (mode "pd"; tsukimi/serving/cluster/cpp_plan.py) started beside
        the prefill workers, each of `cpp_stages` processes computing chunks of
        `cpp_chunk_tokens`; the router sends them the long greedy prompts.
    nice: the engines' lower CPU priority (added to `tsukimi up`'s nice value, 0-19; 0 = the same):
        on a host they share with the router, the router's loop gets the CPU first when it
        needs it, so /health and admission answer under overload (the engines keep every
        cycle it leaves; tsukimi/serving/cluster/supervisor.py).
    """

    prefill: int = 1
    decode: int = 1
    colocated: int = 1
    base_port: int = 0
    cpp_groups: int = 0
    cpp_stages: int = 2
    cpp_chunk_tokens: int = 512
    nice: int = 10
    worker: WorkerConfig = field(default_factory=WorkerConfig, metadata={INLINE_KEYS: SHARED_WORKER_KEYS})

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "colocated", "cpp_groups"):
            require(getattr(self, name) >= 0, f"workers.{name} must be >= 0")
        require(
            self.cpp_stages >= 1 and self.cpp_chunk_tokens >= 1, "workers.cpp_stages and cpp_chunk_tokens must be >= 1"
        )
        _check_port(self.base_port, "workers.base_port")
        require(0 <= self.nice <= 19, f"workers.nice must be within 0..19, got {self.nice}")


@dataclass(frozen=True, slots=True)
class ClusterRouterConfig:
    """Where the OpenAI API listens; served_model_name "" = the model spec; health_port: the
    router's /health and /metrics off its loop (`RouterAppConfig.health_port`; 0: none)."""

    port: int = 8000
    served_model_name: str = ""
    health_port: int = 0

    def __post_init__(self) -> None:
        _check_port(self.port, "router.port")
        _check_port(self.health_port, "router.health_port")


@dataclass(frozen=True, slots=True)
class ClusterRestartConfig:
    """When `tsukimi up` starts a child that died again (tsukimi/serving/cluster/supervisor.py): after
    initial_backoff_s, doubling up to max_backoff_s; more than max_restarts within window_s is a
    crash loop and stops the cluster. max_restarts 0: any child's death stops the cluster."""

    max_restarts: int = 5
    window_s: float = 300.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        require(self.max_restarts >= 0, "restart.max_restarts must be >= 0")
        require(min(self.window_s, self.initial_backoff_s, self.max_backoff_s) > 0, "restart: the times must be > 0")

    def backoff_s(self, recent: int) -> float:
        """The wait before a restart when `recent` restarts happened within the window (pure)."""
        return float(min(self.max_backoff_s, self.initial_backoff_s * 2 ** min(recent, 30)))


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """`tsukimi up` (tsukimi/serving/cluster/up.py). log_dir "" = a new temporary directory.
    metadata_port: the metadata server's (the P2P store's records, for live weight updates;
    0 = a free port)."""

    model: str = "smollm2"
    mode: ClusterMode = "pd"
    host: str = "127.0.0.1"
    log_dir: str = ""
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 10.0
    metadata_port: int = 0
    master: ClusterMasterConfig = field(default_factory=ClusterMasterConfig)
    workers: ClusterWorkersConfig = field(default_factory=ClusterWorkersConfig)
    router: ClusterRouterConfig = field(default_factory=ClusterRouterConfig)
    restart: ClusterRestartConfig = field(default_factory=ClusterRestartConfig)

    def __post_init__(self) -> None:
        require(self.mode in ("pd", "colocated"), f"mode must be pd or colocated, got {self.mode!r}")
        require(self.startup_timeout_s > 0 and self.stop_timeout_s > 0, "the timeouts must be > 0")
        _check_port(self.metadata_port, "metadata_port")
        w = self.workers
        if self.mode == "pd":
            needs = (
                "mode pd needs workers.prefill >= 1 and workers.decode >= 1 (a CPP group counts as a prefill worker)"
            )
            require(w.prefill + w.cpp_groups >= 1 and w.decode >= 1, needs)
        else:
            require(w.colocated >= 1, "mode colocated needs workers.colocated >= 1")
            require(w.cpp_groups == 0, "CPP groups (workers.cpp_groups) need mode pd: they publish to the KV pool")
