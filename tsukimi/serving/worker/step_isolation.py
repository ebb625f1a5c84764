"""What a worker's engine thread (tsukimi/serving/worker/engine_thread.py) does when an engine step
raises: find the request that made it fail, end that one with the error, and keep the others
running on a fresh engine, so that one bad request fails no other.

    step raises -> the engine's state may be inconsistent: a fresh engine
    probe       -> each running request alone, in turn, for one step on the fresh engine
                   (then aborted; its full blocks stay in the prefix cache); those whose step
                   raises are the culprits (the engine is replaced again after each)
    resume      -> the others are added again as prompt + the tokens they already streamed,
                   with the tokens they have left: their stream goes on where it stopped

Resuming recomputes each request's context (from the prefix cache where the probe left it, or
the KV pool). Greedy requests produce the very tokens they would have; a sampled request starts
its generator afresh (seeded as before), so its later tokens may differ from an undisturbed run.
A failure no probe reproduces (the batch, not one request, or a passing fault) resumes everyone
once; should the next step fail again before any step succeeded, every request fails with it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Admitted:
    """What it takes to add a running request again: its prompt, its sampling parameters, and
    the tokens it has streamed so far (mutable: the engine thread appends)."""

    prompt: tuple[int, ...]
    params: SamplingParams
    generated: list[int] = dataclasses.field(default_factory=list)

    def resumed(self) -> tuple[tuple[int, ...], SamplingParams]:
        """The prompt and parameters that continue the request where it stopped (pure)."""
        left = self.params.max_tokens - len(self.generated)
        return (*self.prompt, *self.generated), dataclasses.replace(self.params, max_tokens=max(1, left))


def find_culprits(
    fresh_engine: Callable[[], LLMEngine], requests: Mapping[str, Admitted]
) -> tuple[dict[str, Exception], LLMEngine]:
    """Step each request alone, in turn, on fresh engines (see the module).

    Args:
        fresh_engine: a new, empty engine (called once, then again after each failing probe).
        requests: the requests that were in the engine when its step failed, by id.

    Returns:
        the error of each request whose step failed alone, by id; and an empty engine for the
        others (its prefix cache holds what the probes computed).
    """
    engine, culprits = fresh_engine(), dict[str, Exception]()
    for rid, admitted in requests.items():
        prompt, params = admitted.resumed()
        try:
            engine.add_request(rid, prompt, params)
            engine.step()
        except Exception as exc:  # NOTE: the very failure being looked for: it names the culprit
            logger.warning("request %s fails the engine step alone: %s: %s", rid, type(exc).__name__, exc)
            culprits[rid] = exc
            engine = fresh_engine()
        else:
            engine.abort(rid)
    return culprits, engine


def resume(engine: LLMEngine, requests: Mapping[str, Admitted]) -> None:
    """Add `requests` to `engine` again, each continuing where it stopped (mutates `engine`).

    Raises:
        what `LLMEngine.add_request` raises (the caller then fails them all).
    """
    for rid, admitted in requests.items():
        engine.add_request(rid, *admitted.resumed())
