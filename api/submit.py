"""The engine's requests (`SubmitRequest`), built in one place for every path that enqueues:
the interactive routes and jobs from validated prompts, the reconciler and batches from an
item's row.

A job has `num_copies` items per prompt (OpenAI `n`, TGI and completions `best_of`): copy `c`
of prompt `p` is item `p * copies + c`, and a seeded request's copy `c` samples with seed + c.
The row keeps the prompt's token ids (after truncation) and the parameters (`job_params`), so
`rebuild_request` gives back the request as it was first submitted, only its attempt moved on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tgq.api.db import store
from tgq.api.ids import request_id_of
from tgq.api.settings import Settings
from tgq.api.validated import GenerationParams, ValidatedRequest
from tgq.batcher.grammar import spec_from_wire
from tgq.batcher.messages import SubmitRequest
from tgq.batcher.request import Priority, StoppingParams
from tgq.gpu_worker.plan import SamplingParams

_PARAM_NAMES = frozenset(field.name for field in dataclasses.fields(GenerationParams))


def num_copies(params: GenerationParams) -> int:
    """Items per prompt: independent samples of the same prompt."""
    return max(params.best_of, params.num_choices)


def resolve_max_new_tokens(
    requested: int | None, *, num_prompt_tokens: int, max_total_tokens: int
) -> int:
    """`max_new_tokens` as asked, else what `max_total_tokens` leaves after the prompt: 0 when
    nothing is left (TGI's `saturating_sub`), which validation rejects, naming that 0. So every
    accepted request has at least 1 (`max_input_tokens` < `max_total_tokens`)."""
    if requested is not None:
        return requested
    return max(max_total_tokens - num_prompt_tokens, 0)


def stopping_params(
    params: GenerationParams, *, max_new_tokens: int, eos_token_ids: frozenset[int]
) -> StoppingParams:
    return StoppingParams(
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
        stop_strings=params.stop_strings,
        ignore_eos=params.ignore_eos,
    )


def item_request(
    request_id: str, prompt: ValidatedRequest, *, copy: int = 0, attempt: int = 1
) -> SubmitRequest:
    """Copy `copy` of a validated prompt, as attempt `attempt`."""
    sampling = prompt.sampling
    if copy and sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=sampling.seed + copy)
    return SubmitRequest(
        request_id=request_id,
        prompt_token_ids=prompt.prompt_token_ids,
        sampling=sampling,
        stopping=prompt.stopping,
        priority=prompt.priority,
        deadline=prompt.deadline,
        attempt=attempt,
        grammar=prompt.params.grammar,
        speculate=prompt.params.speculate,
        adapter=prompt.params.adapter,
    )


def job_requests(job_id: str, prompts: Sequence[ValidatedRequest]) -> list[SubmitRequest]:
    """Every item of a job whose prompts share their parameters, in item order."""
    copies = num_copies(prompts[0].params)
    return [
        item_request(request_id_of(job_id, index * copies + copy), prompt, copy=copy)
        for index, prompt in enumerate(prompts)
        for copy in range(copies)
    ]


def job_items(requests: Sequence[SubmitRequest]) -> list[tuple[str, list[int]]]:
    """The job row's items: (request id, prompt token ids)."""
    return [(request.request_id, request.prompt_token_ids) for request in requests]


def job_params(params: GenerationParams) -> dict[str, Any]:
    """The parameters as recorded in the job row (JSON); `recorded_params` reads them back."""
    values = dataclasses.asdict(params)
    values["stop_strings"] = list(params.stop_strings)
    return values


def recorded_params(values: Mapping[str, Any]) -> GenerationParams:
    """The parameters `job_params` recorded. A key this version does not know (a row written by
    another version during a rolling deploy) is left out; a missing one takes its default."""
    known = {name: value for name, value in values.items() if name in _PARAM_NAMES}
    return GenerationParams(
        **{
            **known,
            "sampling": SamplingParams(**values.get("sampling", {})),
            "max_new_tokens": values.get("max_new_tokens"),
            "stop_strings": tuple(values.get("stop_strings", ())),
            "grammar": spec_from_wire(values.get("grammar")),
        }
    )


def rebuild_request(
    item: store.ItemRecord,
    job: store.JobRecord,
    settings: Settings,
    eos_token_ids: frozenset[int],
    *,
    attempt: int | None = None,
) -> SubmitRequest:
    """The item's request as it was first submitted, as attempt `attempt` (default: the one
    after the item's last)."""
    params = recorded_params(item.params or job.params or {})
    max_new_tokens = resolve_max_new_tokens(
        params.max_new_tokens,
        num_prompt_tokens=len(item.prompt_token_ids),
        max_total_tokens=settings.max_total_tokens,
    )
    prompt = ValidatedRequest(
        prompt="",  # not recorded; the engine needs only the token ids
        prompt_token_ids=item.prompt_token_ids,
        params=params,
        # Accepted under the limits of its day: if today's leave it nothing (`max_total_tokens`
        # was lowered since), it still gets the one token no accepted request goes without.
        stopping=stopping_params(
            params, max_new_tokens=max(max_new_tokens, 1), eos_token_ids=eos_token_ids
        ),
        priority=Priority(job.priority if job.priority is not None else Priority.BULK),
        deadline=None if job.deadline is None else job.deadline.timestamp(),
    )
    copy = item.item_index % num_copies(params)
    return item_request(
        item.request_id, prompt, copy=copy, attempt=attempt or max(item.attempts, 1) + 1
    )
