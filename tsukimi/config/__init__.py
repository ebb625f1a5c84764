"""Configuration, the package's bottom layer with clock.py and errors.py: one frozen dataclass
per subsystem, and one loader for every settings file.

    loader.py      load(schema, path, overrides): defaults -> TOML file -> `section.key=value`
    transfer.py    TransferConfig, MetadataConfig, SecurityConfig
    p2p.py         P2PConfig
    store.py       MasterConfig, ClientConfig
    scheduling.py  ConductorConfig (SIMULATOR_CONDUCTOR, ROUTER_CONDUCTOR), LinearCostConfig, SimConfig
    serving.py     WorkerConfig, RouterAppConfig (RouterConfig, VllmBackendConfig), ClusterConfig (+ its tables)

`Config` composes the tables the store and transfer commands read (`tsukimi master`,
`holder`, `metadata-server`). Unknown sections and keys are errors, and each dataclass
validates itself in `__post_init__`, raising `ConfigError` that names the valid choices.
Nothing here imports torch or any layer above (engine, scheduler, serving, sim).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tsukimi.config.loader import INLINE_KEYS, build_dataclass, load, read_settings
from tsukimi.config.p2p import P2PConfig
from tsukimi.config.scheduling import (
    REJECTION_NAMES,
    RESERVATION_NAMES,
    ROUTER_CONDUCTOR,
    SIMULATOR_CONDUCTOR,
    ConductorConfig,
    LinearCostConfig,
    RejectionName,
    ReservationName,
    SimConfig,
)
from tsukimi.config.serving import (
    BACKEND_KINDS,
    DEVICE_NAMES,
    DTYPE_NAMES,
    POLICY_NAMES,
    ROLES,
    SHARED_WORKER_KEYS,
    VLLM_HASH_ALGOS,
    WORKER_DTYPE_NAMES,
    ClusterConfig,
    ClusterMasterConfig,
    ClusterMode,
    ClusterRestartConfig,
    ClusterRouterConfig,
    ClusterWorkersConfig,
    DeviceName,
    DTypeName,
    PolicyName,
    Role,
    RouterAppConfig,
    RouterConfig,
    VllmBackendConfig,
    VllmHashAlgo,
    WorkerConfig,
    WorkerDTypeName,
)
from tsukimi.config.store import PLACEMENT_NAMES, ClientConfig, MasterConfig, PlacementName
from tsukimi.config.transfer import (
    MIB,
    MIN_SECRET_BYTES,
    SECRET_ENV,
    MetadataConfig,
    SecurityConfig,
    TransferConfig,
)

__all__ = [
    "BACKEND_KINDS",
    "DEVICE_NAMES",
    "DTYPE_NAMES",
    "INLINE_KEYS",
    "MIB",
    "MIN_SECRET_BYTES",
    "PLACEMENT_NAMES",
    "POLICY_NAMES",
    "REJECTION_NAMES",
    "RESERVATION_NAMES",
    "ROLES",
    "ROUTER_CONDUCTOR",
    "SECRET_ENV",
    "SHARED_WORKER_KEYS",
    "SIMULATOR_CONDUCTOR",
    "VLLM_HASH_ALGOS",
    "WORKER_DTYPE_NAMES",
    "ClientConfig",
    "ClusterConfig",
    "ClusterMasterConfig",
    "ClusterMode",
    "ClusterRestartConfig",
    "ClusterRouterConfig",
    "ClusterWorkersConfig",
    "ConductorConfig",
    "Config",
    "DTypeName",
    "DeviceName",
    "LinearCostConfig",
    "MasterConfig",
    "MetadataConfig",
    "P2PConfig",
    "PlacementName",
    "PolicyName",
    "RejectionName",
    "ReservationName",
    "Role",
    "RouterAppConfig",
    "RouterConfig",
    "SecurityConfig",
    "SimConfig",
    "TransferConfig",
    "VllmBackendConfig",
    "VllmHashAlgo",
    "WorkerConfig",
    "WorkerDTypeName",
    "build_dataclass",
    "load",
    "read_settings",
]


@dataclass(frozen=True, slots=True)
class Config:
    """Every store and transfer subsystem's configuration (`load(Config, path, overrides)`)."""

    transfer: TransferConfig = field(default_factory=TransferConfig)
    metadata: MetadataConfig = field(default_factory=MetadataConfig)
    master: MasterConfig = field(default_factory=MasterConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    conductor: ConductorConfig = field(default_factory=lambda: SIMULATOR_CONDUCTOR)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    p2p: P2PConfig = field(default_factory=P2PConfig)
