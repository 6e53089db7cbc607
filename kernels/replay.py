"""Record the ops a piece of PyTorch code runs once, then run them again in one C++ call.

On a CPU a small model's decode step spends a good part of its time in Python between the ops
(module calls, wrappers, views: a few microseconds each, ~16 ops per layer). `OpReplay` takes
that away without a second definition of the model: the first call for a key runs the code under
a dispatch mode that records every op it reaches (with the tensors it reads and makes), and the
later calls with that key run the recorded ops in `cpu_ops`' OpProgram, in C++. The ops, their
order and their arguments are the code's own, so the results are bit-identical to it.

A recording is only valid while the code's Python control flow (and every Python number it
passes to an op) depends on nothing but the key: the caller's key must say everything the code
branches on (shapes included). What the recorder can check, it does, and refuses the recording
(the code then runs as it is, for that key) when:
- an op returns something other than tensors (`.item()`, `.tolist()`, a collective's work
  handle): Python read a value, and may have branched on it;
- an op reads a tensor that is neither an input, nor made by an earlier op, nor one of the
  `constants` (the module's parameters and buffers): it may change from call to call;
- an optional-tensor list argument (`Tensor?[]`) holds a tensor made during the call.

Python side effects other than ops (a module caching something) are not replayed either.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tgq.kernels import cpu_ops

logger = logging.getLogger(__name__)

# Programs one OpReplay keeps (a decode step has one per batch size): past it, new keys run as
# plain code.
MAX_PROGRAMS = 1024


# Where an op argument comes from, besides a register (OpProgram's kConstant, kTensorList).
CONSTANT = -1
TENSOR_LIST = -2


class ReplayRefusedError(Exception):
    """The recorded call cannot be replayed; the message says why."""


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's, untyped
    """Builds an OpProgram from the ops the code reaches (each op also runs, as usual)."""

    def __init__(self, inputs: Sequence[torch.Tensor], constants: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.program = cpu_ops.op_program(len(inputs))
        self._registers = {id(tensor): i for i, tensor in enumerate(inputs)}
        self._constants = constants
        self._alive: list[Any] = list(inputs)  # ids stay unique while the recording lasts
        self.refused: str | None = None

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.refused is None:
            try:
                self._record(func, args, kwargs, out)
            except ReplayRefusedError as refused:
                self.refused = str(refused)
        return out

    def register_of(self, tensor: torch.Tensor) -> int:
        register = self._registers.get(id(tensor))
        if register is None:
            raise ReplayRefusedError("the result was not made by a recorded op")
        return register

    def _record(
        self, func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any], out: Any
    ) -> None:
        schema = func._schema
        sources: list[int] = []
        values: list[Any] = []
        lists: list[list[int]] = []
        for index, argument in enumerate(schema.arguments):
            if index < len(args) and not argument.kwarg_only:
                value = args[index]
            elif argument.name in kwargs:
                value = kwargs[argument.name]
            elif argument.has_default_value():
                value = argument.default_value
            else:
                raise ReplayRefusedError(f"{schema.name}: no value for {argument.name}")
            if str(argument.type) == "List[Tensor]":
                sources.append(TENSOR_LIST)
                values.append(None)
                lists.append([self._register(schema.name, tensor) for tensor in value])
                continue
            source = self._source(schema.name, value)
            sources.append(source)
            values.append(None if source >= 0 else value)
            lists.append([])
        outputs = _tensors_out(schema.name, out)
        first = self.program.add(
            schema.name, schema.overload_name, sources, values, lists, len(outputs)
        )
        for offset, tensor in enumerate(outputs):
            self._registers[id(tensor)] = first + offset
        self._alive += outputs

    def _source(self, op: str, value: Any) -> int:
        """The register a tensor argument comes from, or CONSTANT for any other value."""
        if isinstance(value, torch.Tensor):
            return self._register(op, value)
        if isinstance(value, list | tuple):  # Tensor?[] and the like: constants only
            for item in value:
                if isinstance(item, torch.Tensor) and id(item) not in self._constants:
                    raise ReplayRefusedError(f"{op} takes a list that holds a tensor of the call")
        return CONSTANT

    def _register(self, op: str, tensor: torch.Tensor) -> int:
        """The register of `tensor`: an input's, an earlier op's result's, or one the program
        keeps for a constant (a parameter or buffer of the owner)."""
        register = self._registers.get(id(tensor))
        if register is None:
            if id(tensor) not in self._constants:
                raise ReplayRefusedError(
                    f"{op} reads a tensor that is neither an input, an op's result nor a constant"
                )
            register = self._registers[id(tensor)] = self.program.keep(tensor)
            self._alive.append(tensor)
        return register


def _tensors_out(op: str, out: Any) -> list[torch.Tensor]:
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [tensor for item in out for tensor in _tensors_out(op, item)]
    raise ReplayRefusedError(f"{op} returns {type(out).__name__}, which Python may branch on")


def record(
    run: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor], constants: set[int]
) -> tuple[torch.Tensor, Any]:
    """Runs `run()` (which reads `inputs`) once, recording its ops: (its result, the OpProgram),
    or (its result, the reason it cannot be replayed). `constants`: ids of the tensors the
    program may keep."""
    recorder = _Recorder(inputs, constants)
    with recorder:
        result = run()
    if recorder.refused is None:
        try:
            recorder.program.set_result(recorder.register_of(result))
        except ReplayRefusedError as refused:
            recorder.refused = str(refused)
    return result, recorder.refused or recorder.program


class OpReplay:
    """Runs `run()` for a key as recorded from its first call with that key (see the module's
    docstring for what the key must hold). `owner`: the module whose parameters and buffers the
    code reads; they are the only tensors a program keeps."""

    def __init__(self, owner: torch.nn.Module, *, max_programs: int = MAX_PROGRAMS) -> None:
        self._owner = owner
        self._max_programs = max_programs
        self._programs: dict[Hashable, Any] = {}  # None: refused for that key
        self.refusals: dict[Hashable, str] = {}  # key -> why

    def __call__(
        self, key: Hashable, inputs: Sequence[torch.Tensor], run: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        if key in self._programs:
            program = self._programs[key]
            if program is None:
                return run()
            result: torch.Tensor = program.run(list(inputs))
            return result
        if len(self._programs) >= self._max_programs:
            return run()
        result, program = record(run, inputs, _ids(self._owner))
        if isinstance(program, str):
            # Once as a warning: a model that cannot be replayed would refuse every key.
            log = logger.debug if self.refusals else logger.warning
            log("op replay refused for %r: %s; such calls run as Python", key, program)
            self.refusals[key] = program
            program = None
        self._programs[key] = program
        return result

    @property
    def keys(self) -> list[Hashable]:
        """The keys with a program."""
        return [key for key, program in self._programs.items() if program is not None]


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensor fields of a dataclass (attention metadata), in field order."""
    values = (getattr(obj, field.name) for field in dataclasses.fields(obj))
    return [value for value in values if isinstance(value, torch.Tensor)]


def _ids(module: torch.nn.Module) -> set[int]:
    tensors: Iterable[torch.Tensor] = (*module.parameters(), *module.buffers())
    return {id(tensor) for tensor in tensors}
