"""Chunked pipeline parallelism (CPP) in the cost model: how long a prefill group of k stages
takes over a prompt, and when a prompt is long enough to be worth a group.

A group of k stages holds L / k layers each; the prompt's N new tokens are cut into n chunks.
Chunk j costs the whole model t_j (`CostModel.prefill_s` of the chunk after the tokens before
it), so t_j / k on one stage, and its hidden states [C_j, hidden] cross each of the k - 1
stage boundaries in h_j. Stage s finishes chunk j at

    F(s, j) = max(F(s - 1, j) + h_j, F(s, j - 1)) + t_j / k        (F(., -1) = F(-1, .) = 0)

and the first token is ready at F(k - 1, n - 1). With equal chunks (t_j = t, h_j = h) this is
the pipeline-fill formula

    TTFT_cpp = (n + k - 1) * t / k + (k - 1) * h

against n * t on one instance: the speed-up k n / (n + k - 1) tends to k as chunks get finer
(the fill costs k - 1 chunk-stage slots), while every chunk pays its own fixed step cost.
Causal attention makes later chunks dearer, which the recurrence follows exactly.

The Conductor prices a group as one prefill instance with this estimate (`CppGroup`), so it
sends a prompt to a group exactly when the group's TTFT (queue included) beats every single
instance's: long prompts, in practice. Pure functions and frozen data.
"""

from __future__ import annotations

from dataclasses import dataclass

from tsukimi.errors import InvalidArgument
from tsukimi.scheduler.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class CppGroup:
    """A prefill group: `stages` instances in a pipeline; each chunk's hidden states take
    `hop_s_per_token` seconds per token per stage boundary (hidden bytes / link bandwidth)
    plus `hop_latency_s`. `chunk_tokens`: the group's own pipeline chunk (0: the caller's,
    e.g. the Conductor's `prefill_chunk_tokens`)."""

    stages: int
    hop_s_per_token: float = 0.0
    hop_latency_s: float = 0.0
    chunk_tokens: int = 0

    def __post_init__(self) -> None:
        if self.stages < 1 or self.hop_s_per_token < 0 or self.hop_latency_s < 0 or self.chunk_tokens < 0:
            raise InvalidArgument("a CPP group needs stages >= 1, hop times >= 0 and chunk_tokens >= 0")

    def prefill_s(self, cost: CostModel, new_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
        """`cpp_prefill_s` of this group, in chunks of its own `chunk_tokens` when set, else of
        `chunk_tokens` (pure)."""
        return cpp_prefill_s(cost, new_tokens, cached_tokens, self.chunk_tokens or chunk_tokens, self)


def hop_s_per_token(hidden_size: int, dtype_bytes: int, link_bytes_s: float) -> float:
    """Seconds to move one token's hidden state across one stage boundary (pure)."""
    return hidden_size * dtype_bytes / link_bytes_s


def cpp_prefill_s(cost: CostModel, new_tokens: int, cached_tokens: int, chunk_tokens: int, group: CppGroup) -> float:
    """Prefill time of `new_tokens` after `cached_tokens` on `group`, chunks of at most
    `chunk_tokens` (the recurrence of the module; with one stage, `chunked_prefill_s`). Pure."""
    if chunk_tokens < 1:
        raise InvalidArgument(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    k = group.stages
    finish = [0.0] * k  # finish[s]: when stage s finished its latest chunk
    done = 0
    while done < new_tokens:
        size = min(chunk_tokens, new_tokens - done)
        stage_s = cost.prefill_s(size, cached_tokens + done) / k
        hop_s = group.hop_latency_s + size * group.hop_s_per_token
        ready = 0.0  # when this chunk's input reaches stage s
        for s in range(k):
            finish[s] = max(ready, finish[s]) + stage_s
            ready = finish[s] + hop_s
        done += size
    return finish[-1]


def pipeline_fill_s(num_chunks: int, chunk_s: float, stages: int, hop_s: float = 0.0) -> float:
    """The closed form for equal chunks: (n + k - 1) * t / k + (k - 1) * h (pure)."""
    if num_chunks <= 0:
        return 0.0
    return (num_chunks + stages - 1) * chunk_s / stages + (stages - 1) * hop_s


def worth_a_group(
    cost: CostModel, new_tokens: int, cached_tokens: int, chunk_tokens: int, group: CppGroup, margin: float = 1.0
) -> bool:
    """Whether `group` gives the prompt a lower TTFT than one instance, both idle, by at least
    `margin` (e.g. 0.9: 10 % lower). Pure."""
    single = cpp_prefill_s(cost, new_tokens, cached_tokens, chunk_tokens, CppGroup(1))
    return group.prefill_s(cost, new_tokens, cached_tokens, chunk_tokens) < margin * single


def min_group_tokens(cost: CostModel, chunk_tokens: int, group: CppGroup, limit_tokens: int = 1 << 20) -> int | None:
    """The shortest prompt (no cache) for which `group` beats one idle instance (None: none up
    to `limit_tokens`): the Conductor's length threshold, for reports. Pure; bisects, assuming
    the advantage grows with length."""
    if not worth_a_group(cost, limit_tokens, 0, chunk_tokens, group):
        return None
    low, high = 1, limit_tokens
    while low < high:
        mid = (low + high) // 2
        if worth_a_group(cost, mid, 0, chunk_tokens, group):
            high = mid
        else:
            low = mid + 1
    return low
