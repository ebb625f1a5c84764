"""How long model work takes: prefill, decode steps and KV transfers, for the Conductor's
estimates and for the simulator's instances (the same numbers drive both).

Two models behind one protocol:

- `RooflineCostModel`: a roofline over a model and a node: each step takes the longer of its
  FLOPs at an achieved fraction of peak and its bytes (weights + KV read) at an achieved
  fraction of memory bandwidth, plus a fixed per-step overhead. The shipped default
  (`llama2_70b_8xa800`) is the paper's set-up.
- `LinearCostModel`: coefficients fitted by least squares from measured profiles
  (`fit_linear`); the serving issue fits the built-in engine with it. A configured one is
  built from its settings, `LinearCostConfig` (the router's `[router.cost]` table):
  `LinearCostModel.from_config`.

Prefill of `n` new tokens after `c` cached ones: the linear layers cost 2 * params FLOPs per
token and causal attention 4 * layers * q_dim FLOPs per (query, key) pair, with
n * c + n * (n + 1) / 2 pairs. A decode step over `b` requests holding `t` context tokens in
total reads every weight once and every KV byte of the batch once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tsukimi.config import LinearCostConfig
from tsukimi.errors import ConfigError, InvalidArgument


class CostModel(Protocol):
    """Durations in seconds; pure."""

    kv_bytes_per_token: int

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Compute `new_tokens` of a prompt whose first `cached_tokens` have KV already."""
        ...

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode iteration producing one token for each of `batch` requests holding
        `context_tokens` in total."""
        ...

    def mixed_step_s(self, prefill_tokens: int, prefill_context: int, batch: int, context_tokens: int) -> float:
        """One colocated iteration: a prefill chunk and a decode step run together."""
        ...

    def transfer_s(self, tokens: int, bandwidth_bytes_s: float) -> float:
        """Move the KV of `tokens` tokens at `bandwidth_bytes_s`."""
        ...


def attention_pairs(new_tokens: int, cached_tokens: int) -> float:
    """(query, key) pairs of causal attention for `new_tokens` after `cached_tokens`."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder's shape. q_dim = heads * head_dim; the KV of one token holds
    2 * layers * kv_heads * head_dim values of `dtype_bytes`."""

    name: str
    params: float
    layers: int
    q_dim: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One instance's hardware: `gpus` GPUs of `flops` peak and `mem_bytes_s` memory
    bandwidth each; `mfu` / `mbu`: the fractions a real engine achieves; `step_overhead_s`:
    launch and scheduling time per iteration; `hbm_bytes`: memory per GPU."""

    name: str
    gpus: int
    flops: float
    mem_bytes_s: float
    hbm_bytes: float
    mfu: float = 0.5
    mbu: float = 0.7
    step_overhead_s: float = 0.005

    def __post_init__(self) -> None:
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1):
            raise ConfigError("mfu and mbu must be in (0, 1]")


LLAMA2_70B = ModelSpec("llama2-70b", params=69e9, layers=80, q_dim=8192, kv_heads=8, head_dim=128)
A800_X8 = NodeSpec("8xA800-80G", gpus=8, flops=312e12, mem_bytes_s=2.039e12, hbm_bytes=80e9)


class RooflineCostModel:
    """max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) + overhead, per iteration."""

    def __init__(self, model: ModelSpec = LLAMA2_70B, node: NodeSpec = A800_X8) -> None:
        self.model, self.node = model, node
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self._flops_s = node.gpus * node.flops * node.mfu
        self._bytes_s = node.gpus * node.mem_bytes_s * node.mbu
        self._weight_bytes = model.params * model.dtype_bytes
        self._attn_flops = 4.0 * model.layers * model.q_dim

    def kv_capacity_tokens(self, reserve: float = 0.1) -> int:
        """Tokens of KV that fit in the node's memory beside the weights, keeping `reserve`
        of it for activations."""
        free = self.node.gpus * self.node.hbm_bytes * (1 - reserve) - self._weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))

    def _step(self, flops: float, kv_tokens_read: float) -> float:
        memory = (self._weight_bytes + kv_tokens_read * self.kv_bytes_per_token) / self._bytes_s
        return max(flops / self._flops_s, memory) + self.node.step_overhead_s

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        flops = 2 * self.model.params * new_tokens + self._attn_flops * attention_pairs(new_tokens, cached_tokens)
        return self._step(flops, cached_tokens + new_tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self._step(2 * self.model.params * batch + self._attn_flops * context_tokens, context_tokens)

    def mixed_step_s(self, prefill_tokens: int, prefill_context: int, batch: int, context_tokens: int) -> float:
        flops = 2 * self.model.params * (prefill_tokens + batch) + self._attn_flops * (
            attention_pairs(prefill_tokens, prefill_context) + context_tokens
        )
        if prefill_tokens <= 0 and batch <= 0:
            return 0.0
        return self._step(flops, context_tokens + prefill_context + prefill_tokens)

    def transfer_s(self, tokens: int, bandwidth_bytes_s: float) -> float:
        return tokens * self.kv_bytes_per_token / bandwidth_bytes_s if tokens > 0 else 0.0


def chunked_prefill_s(cost: CostModel, new_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
    """Prefill of `new_tokens` after `cached_tokens`, at most `chunk_tokens` per iteration
    (each iteration pays its weights read and overhead); pure."""
    total, done = 0.0, 0
    while done < new_tokens:
        step = min(chunk_tokens, new_tokens - done)
        total += cost.prefill_s(step, cached_tokens + done)
        done += step
    return total


@dataclass(frozen=True, slots=True)
class LinearCostModel:
    """Fitted: prefill = p0 + p1 * new + p2 * attention_pairs(new, cached);
    decode step = d0 + d1 * batch + d2 * context_tokens. Coefficients in seconds."""

    prefill_coef: tuple[float, float, float]
    decode_coef: tuple[float, float, float]
    kv_bytes_per_token: int

    @classmethod
    def from_config(cls, config: LinearCostConfig) -> LinearCostModel:
        """The model of `config`'s coefficients (pure)."""
        c = config
        return cls(
            (c.prefill_base_s, c.prefill_token_s, c.prefill_pair_s),
            (c.decode_step_s, c.decode_request_s, c.decode_context_token_s),
            c.kv_bytes_per_token,
        )

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        p0, p1, p2 = self.prefill_coef
        return p0 + p1 * new_tokens + p2 * attention_pairs(new_tokens, cached_tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        d0, d1, d2 = self.decode_coef
        return d0 + d1 * batch + d2 * context_tokens

    def mixed_step_s(self, prefill_tokens: int, prefill_context: int, batch: int, context_tokens: int) -> float:
        # NOTE: one iteration pays the fixed cost once.
        both = self.prefill_s(prefill_tokens, prefill_context) + self.decode_step_s(batch, context_tokens)
        shared = min(self.prefill_coef[0], self.decode_coef[0]) if prefill_tokens > 0 and batch > 0 else 0.0
        return both - shared

    def transfer_s(self, tokens: int, bandwidth_bytes_s: float) -> float:
        return tokens * self.kv_bytes_per_token / bandwidth_bytes_s if tokens > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PrefillSample:
    new_tokens: int
    cached_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    batch: int
    context_tokens: int
    seconds: float


def fit_linear(
    prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample], kv_bytes_per_token: int
) -> LinearCostModel:
    """Least-squares coefficients (non-negative: a negative one is dropped and the rest
    refitted) from measured profiles; pure.

    Raises:
        InvalidArgument: fewer than 3 samples of either kind, or a non-finite/negative time.
    """
    if len(prefill) < 3 or len(decode) < 3:
        raise InvalidArgument("fitting needs at least 3 prefill and 3 decode samples")
    if any(not (math.isfinite(t) and t >= 0) for t in [*(s.seconds for s in prefill), *(s.seconds for s in decode)]):
        raise InvalidArgument("sample times must be finite and >= 0")
    pre = _nonnegative_lstsq(
        [[1.0, s.new_tokens, attention_pairs(s.new_tokens, s.cached_tokens)] for s in prefill],
        [s.seconds for s in prefill],
    )
    dec = _nonnegative_lstsq([[1.0, s.batch, s.context_tokens] for s in decode], [s.seconds for s in decode])
    return LinearCostModel((pre[0], pre[1], pre[2]), (dec[0], dec[1], dec[2]), kv_bytes_per_token)


def _nonnegative_lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        # NOTE: scale columns so that token counts and squared token counts are comparable.
        cols = a[:, active]
        scale = np.maximum(np.abs(cols).max(axis=0), 1e-30)
        solution = np.linalg.lstsq(cols / scale, b, rcond=None)[0] / scale
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return [float(c) for c in coef]
