"""The engine's requests, built in one place: item order and copies' seeds, the default
`max_new_tokens` (one rule for validation and for rebuilds from a row), and the recorded
parameters read back exactly."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from tgq.api.db import store
from tgq.api.errors import ValidationError
from tgq.api.settings import Settings
from tgq.api.submit import (
    job_items,
    job_params,
    job_requests,
    rebuild_request,
    recorded_params,
    resolve_max_new_tokens,
)
from tgq.api.validated import GenerationParams, ValidatedRequest
from tgq.api.validation import validate_tokens
from tgq.batcher.grammar import GrammarSpec
from tgq.batcher.request import Priority
from tgq.gpu_worker.plan import SamplingParams

SETTINGS = Settings.model_validate({"max_input_tokens": 6, "max_total_tokens": 10})
EOS = frozenset({2})
SCHEMA = {"type": "integer", "maximum": 3}
DEADLINE = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


def validated(
    token_ids: list[int], params: GenerationParams, settings: Settings = SETTINGS
) -> ValidatedRequest:
    return validate_tokens(
        prompt="p", token_ids=token_ids, params=params, settings=settings,
        priority=Priority.BULK, deadline=DEADLINE.timestamp(), eos_token_ids=EOS,
    )  # fmt: skip


def params_of(seed: int | None = 11, **fields: Any) -> GenerationParams:
    sampling = SamplingParams(temperature=0.7, seed=seed, min_tokens=1)
    return GenerationParams(sampling=sampling, max_new_tokens=None, **fields)


def job_record(job_id: str, params: GenerationParams, *, priority: int | None) -> store.JobRecord:
    return store.JobRecord(
        id=job_id, kind="job", route="/v1/jobs", status="queued", priority=priority, model="m",
        params=job_params(params), num_items=0, num_items_done=0, num_items_failed=0,
        prompt_tokens=0, completion_tokens=0, idempotency_scope="", idempotency_key=None,
        idempotency_fingerprint=None, api_key_id=None, deadline=DEADLINE, created_at=DEADLINE,
        started_at=None, finished_at=None, error=None, metadata=None,
    )  # fmt: skip


def item_record(job_id: str, index: int, token_ids: list[int], attempts: int) -> store.ItemRecord:
    request_id = f"{job_id}.{index}"
    return store.ItemRecord(
        job_id, index, request_id, token_ids, "queued", attempts, DEADLINE, None, None
    )


@pytest.mark.parametrize(
    ("requested", "num_prompt_tokens", "expected"),
    [
        (3, 5, 3),  # as asked, whatever is left
        (None, 4, 6),  # what max_total_tokens (10) leaves
        (None, 9, 1),
        (None, 10, 0),  # nothing left: 0, as TGI's saturating_sub; validation rejects it
        (None, 11, 0),
    ],
)
def test_max_new_tokens_defaults_to_what_is_left(
    requested: int | None, num_prompt_tokens: int, expected: int
) -> None:
    resolved = resolve_max_new_tokens(
        requested, num_prompt_tokens=num_prompt_tokens, max_total_tokens=10
    )
    assert resolved == expected


def test_every_accepted_request_has_a_new_token_and_none_with_nothing_left_is() -> None:
    settings = Settings.model_validate({"max_total_tokens": 10})  # max_input_tokens: 9
    longest = validated(list(range(settings.max_input_tokens)), params_of(), settings)
    assert longest.stopping.max_new_tokens == 1
    with pytest.raises(ValidationError) as caught:
        validated(list(range(11)), params_of())
    assert caught.value.message == (
        "`inputs` tokens + `max_new_tokens` must be <= 10. Given: 11 `inputs` tokens and 0 "
        "`max_new_tokens`"
    )


def test_job_requests_number_items_by_prompt_then_copy_and_shift_seeds() -> None:
    params = params_of(num_choices=3, stop_strings=("\n",))
    prompts = [validated([5, 6, 7], params), validated([8, 9], params)]
    requests = job_requests("job_x", prompts)
    assert [r.request_id for r in requests] == [f"job_x.{i}" for i in range(6)]
    assert [r.prompt_token_ids for r in requests] == [[5, 6, 7]] * 3 + [[8, 9]] * 3
    assert [r.sampling.seed for r in requests] == [11, 12, 13] * 2
    assert [r.stopping.max_new_tokens for r in requests] == [7] * 3 + [8] * 3
    for request in requests:
        assert request.stopping.stop_strings == ("\n",) and request.stopping.eos_token_ids == EOS
        assert (request.priority, request.deadline) == (Priority.BULK, DEADLINE.timestamp())
        assert request.attempt == 1
    assert job_items(requests)[4] == ("job_x.4", [8, 9])


def test_unseeded_copies_stay_unseeded() -> None:
    requests = job_requests("job_x", [validated([5], params_of(seed=None, best_of=2))])
    assert [r.sampling.seed for r in requests] == [None, None]


def test_recorded_params_read_back_what_was_recorded() -> None:
    params = params_of(
        stop_strings=("a", "b"), ignore_eos=True, truncate=4, best_of=2, details=True,
        speculate=False,
        top_n_tokens=3, add_special_tokens=False, grammar=GrammarSpec.json_schema(SCHEMA),
    )  # fmt: skip
    assert recorded_params(job_params(params)) == params
    assert json.loads(json.dumps(job_params(params)))["grammar"] == {
        "kind": "json_schema",
        "value": '{"type":"integer","maximum":3}',
    }
    assert recorded_params({}) == GenerationParams(sampling=SamplingParams(), max_new_tokens=None)
    # A key of another version is left out (a rolling deploy writes and reads rows).
    assert recorded_params({**job_params(params), "renamed_since": 1}) == params


def test_rebuild_gives_back_the_request_first_submitted() -> None:
    params = params_of(num_choices=2, stop_strings=("\n",), grammar=GrammarSpec.json_schema(SCHEMA))
    first = job_requests("job_x", [validated([5, 6, 7], params), validated([8, 9], params)])
    job = job_record("job_x", params, priority=int(Priority.BULK))
    for index, request in enumerate(first):
        item = item_record("job_x", index, request.prompt_token_ids, attempts=1)
        rebuilt = rebuild_request(item, job, SETTINGS, EOS)
        assert rebuilt == dataclasses.replace(request, attempt=2)
        assert rebuilt.grammar == params.grammar
        assert rebuild_request(item, job, SETTINGS, EOS, attempt=5).attempt == 5


def test_rebuild_under_lowered_limits_still_gets_one_token() -> None:
    """An item accepted when `max_total_tokens` was higher is never made an invalid request."""
    job = job_record("job_x", params_of(), priority=None)
    item = item_record("job_x", 0, list(range(12)), attempts=0)
    rebuilt = rebuild_request(item, job, SETTINGS, EOS)
    assert rebuilt.stopping.max_new_tokens == 1
    assert rebuilt.priority == Priority.BULK and rebuilt.attempt == 2  # attempts 0 counts as 1
