"""Schemathesis against the OpenAPI document of a live api process (on the real stack: its
batcher, Postgres, Redis): a bounded, derandomized number of generated requests per operation
(no shrinking, no deadline). No answer may be a 5xx, and every answer must match the document:
its declared content type and, where the document gives one, its schema.

The api under test has small token limits, so that generated requests are cheap to run or to
refuse; what is checked is the edge, not the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis import checks

from tests.api.stack import Stack
from tests.api.test_http_limits import sibling_api

pytestmark = pytest.mark.timeout(300)

MAX_EXAMPLES = 5  # per operation (10 took ~4 minutes of the suite's 2 cores)
SMALL_LIMITS = {"MAX_INPUT_TOKENS": "16", "MAX_TOTAL_TOKENS": "32"}
CHECKS = [
    checks.not_a_server_error,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


@pytest.fixture(scope="module")
def small_api(stack: Stack) -> Iterator[Stack]:
    with sibling_api(stack, "api-schemathesis", **SMALL_LIMITS) as api:
        yield api


@pytest.fixture(scope="module")
def api_schema(small_api: Stack) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{small_api.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_answers_conform_to_the_document(case: schemathesis.Case[Any]) -> None:
    case.call_and_validate(checks=CHECKS, timeout=30)
