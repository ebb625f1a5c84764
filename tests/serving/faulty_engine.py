"""An engine factory for fault tests: `tsukimi worker --engine-factory
tests.serving.faulty_engine:FaultyEngine` (with the checkout on PYTHONPATH) runs a worker whose
engine fails every step that schedules a request whose prompt holds POISON, as a bug would.

It is `LLMEngine` with a check between schedule and run (the step's three lines, once more):
the product's engine carries no hook for it (tsukimi/serving/worker/engine_factory.py).
"""

from __future__ import annotations

from tsukimi.engine.engine import LLMEngine, StepOutput

POISON = 31999  # NOTE: a token id of the tiny model (vocabulary 32000) that no test prompt holds by chance


class InjectedFault(RuntimeError):
    """A step failed on purpose: a bug's stand-in, so not a TsukimiError."""


class FaultyEngine(LLMEngine):
    """An `LLMEngine` whose step raises InjectedFault when it schedules a poisoned prompt."""

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if any(POISON in scheduled.request.prompt for scheduled in batch.requests):
            raise InjectedFault(f"a request with token {POISON} in its prompt was scheduled")
        tokens = self.runner.run(batch)
        return self.scheduler.postprocess(batch, tokens, recompute=self.runner.failed)
