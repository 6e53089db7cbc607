"""Fault injection, for reliability tests only: `python -m tgq.batcher --inject-fault engine_step:N`
makes the runner raise on its Nth step, so a test sees what a real engine failure does to the
requests in flight, to `/health` and to the batcher's exit code.

The option is read once at start-up; without it the runner is not wrapped, so the serving path
carries no test-only branch.
"""

from __future__ import annotations

from tgq.batcher.engine import StepRunner
from tgq.gpu_worker.plan import StepPlan, StepResult

KINDS = ("engine_step",)


class InjectedFaultError(RuntimeError):
    """The failure `--inject-fault` asked for."""


class FailingRunner:
    """Runs `runner` and raises `InjectedFaultError` on step `fail_at_step` (1-based) instead."""

    def __init__(self, runner: StepRunner, fail_at_step: int) -> None:
        self.runner = runner
        self.fail_at_step = fail_at_step
        self.num_steps = 0

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise InjectedFaultError(f"injected fault at engine step {self.num_steps}")
        return self.runner.execute(plan)


def parse_fault(spec: str) -> int:
    """The step number of `engine_step:N` (N >= 1); ValueError for anything else."""
    kind, _, value = spec.partition(":")
    if kind not in KINDS or not value.isdigit() or int(value) < 1:
        raise ValueError(f"--inject-fault wants engine_step:N with N >= 1, not {spec!r}")
    return int(value)


def inject_fault(runner: StepRunner, spec: str | None) -> StepRunner:
    """`runner` itself when no fault is asked for."""
    return runner if spec is None else FailingRunner(runner, parse_fault(spec))
