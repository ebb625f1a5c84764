"""Choosing the next token: greedy, or temperature with nucleus (top-p) sampling, seeded per
request so that a run can be replayed; and when a request stops."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tsukimi.errors import InvalidArgument

MAX_TOKENS_LIMIT = 1 << 16
MIN_SAMPLING_VALUE = 1e-6  # smaller positive temperatures and top_p break sampling in float32


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """max_tokens: tokens to generate at most; temperature 0 = greedy; top_p in (0, 1];
    stop_token_ids: end the output (the token is not emitted); ignore_eos: keep going past EOS;
    seed: makes sampling reproducible (None: seeded from the request id)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise InvalidArgument(f"max_tokens must be in 1..{MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        # NOTE: a tinier positive temperature overflows logits / temperature to inf, a tinier
        # top_p is 0 in float32, a seed past 63 bits makes torch's manual_seed raise: each
        # failed on the engine thread, taking every running request with it (found by tests/fuzz)
        if not (self.temperature == 0 or MIN_SAMPLING_VALUE <= self.temperature <= 100):
            raise InvalidArgument(f"temperature must be 0 or in [{MIN_SAMPLING_VALUE}, 100], got {self.temperature}")
        if not MIN_SAMPLING_VALUE <= self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in [{MIN_SAMPLING_VALUE}, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument(f"seed must be in 0..2**63-1, got {self.seed}")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The next token from one row of logits (float32, [vocab]); pure apart from `generator`."""
    if params.temperature == 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        ordered, index = torch.sort(probs, descending=True)
        keep = torch.cumsum(ordered, dim=-1) - ordered < params.top_p  # the smallest set reaching top_p
        ordered = torch.where(keep, ordered, torch.zeros_like(ordered))
        choice = torch.multinomial(ordered / ordered.sum(), 1, generator=generator)
        return int(index[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def stop_reason(token: int, num_generated: int, params: SamplingParams, eos_ids: tuple[int, ...]) -> str | None:
    """ "stop" when `token` ends the output, "length" when max_tokens is reached, else None."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
