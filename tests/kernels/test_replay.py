"""OpReplay: a recorded call's ops run again in C++ give what the code gives, bit for bit, and
whatever the recorder cannot prove safe is refused and runs as Python."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.kernels.markers import requires_kernels
from tgq.kernels.replay import OpReplay

pytestmark = requires_kernels


class Block(nn.Module):
    """Views, a split into a list, in-place updates of an input, a parameter and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 12)
        self.register_buffer("shift", torch.linspace(-1, 1, 4))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        a, b, c = self.proj(x).split(4, dim=-1)
        mixed = (torch.sigmoid(a) * b).view(-1, 2, 2).reshape(-1, 4) + c * self.shift
        residual.add_(mixed.sum(-1, keepdim=True))
        return torch.cat([mixed, residual], dim=-1)


class Counted:
    """The code to replay, counting the calls that ran as Python."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.fn()


def inputs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=gen), torch.randn(rows, 1, generator=gen)


@torch.inference_mode()
def test_replayed_calls_equal_the_code_on_new_inputs() -> None:
    torch.manual_seed(0)
    block = Block()
    replay = OpReplay(block)
    for seed in range(4):
        x, residual = inputs(3, seed)
        expected_residual = residual.clone()
        expected = block(x, expected_residual)
        code = Counted(functools.partial(block, x, residual))
        out = replay(("rows", 3), [x, residual], code)
        assert torch.equal(out, expected)
        assert torch.equal(residual, expected_residual)  # the in-place update happened too
        assert code.calls == (1 if seed == 0 else 0)  # recorded once, then replayed
    assert replay.keys == [("rows", 3)] and not replay.refusals


@torch.inference_mode()
def test_each_key_gets_its_own_program_up_to_the_limit() -> None:
    block = Block()
    replay = OpReplay(block, max_programs=2)
    for rows in (1, 2, 5, 5):
        x, residual = inputs(rows, rows)
        expected = block(x, residual.clone())
        code = Counted(functools.partial(block, x, residual))
        assert torch.equal(replay(rows, [x, residual], code), expected)
    assert replay.keys == [1, 2]  # the third key ran as Python, and was not recorded


class ReadsAValue(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum().item() > 0 else x * 3


class ReadsAForeignTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(4)  # neither a parameter nor a buffer: may change between calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


@torch.inference_mode()
@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (ReadsAValue(), "aten::item returns float"),
        (ReadsAForeignTensor(), "aten::mul reads a tensor that is neither an input"),
    ],
)
def test_code_that_depends_on_more_than_the_key_is_refused(
    module: nn.Module, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    replay = OpReplay(module)
    with caplog.at_level(logging.WARNING, logger="tgq.kernels.replay"):
        for sign in (1.0, -1.0, 1.0):
            x = torch.full((2, 4), sign)
            code = Counted(functools.partial(module, x))
            assert torch.equal(replay("k", [x], code), module(x))
            assert code.calls == 1  # every call ran as Python
    assert replay.keys == [] and replay.refusals["k"].startswith(reason)
    assert [r.message.startswith("op replay refused for 'k'") for r in caplog.records] == [True]
    if isinstance(module, ReadsAForeignTensor):  # replaying would have kept the old scale
        module.scale = torch.full((4,), 5.0)
        x = torch.ones(2, 4)
        assert torch.equal(replay("k", [x], lambda: module(x)), torch.full((2, 4), 5.0))
