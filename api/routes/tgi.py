"""TGI's own routes: `/generate`, `/generate_stream`, `/` (TGI's Python client posts here),
`/tokenize`, `/info`, `/health`, `/ping`, `/metrics`, and TGI's OpenAPI path.

Streams are validated, admitted and enqueued before the response starts, so an invalid stream
request gets a real 4xx. After that, errors are SSE events (`{"error", "error_type"}`); TGI's
stream has no `[DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from tgq.api.app import VERSION, AppState, state_of
from tgq.api.db import batches, store
from tgq.api.errors import ApiError, GenerationError, error_body
from tgq.api.limits import served_dtype
from tgq.api.metrics import CONTENT_TYPE
from tgq.api.request_fields import check_parameter_fields, check_tgi_fields
from tgq.api.routes.tgi_answers import (
    finish_reason,
    generate_response,
    tgi_text,
    timing_headers,
    token,
    top_tokens,
)
from tgq.api.run import Run, check_failed
from tgq.api.schemas.tgi import (
    CompatGenerateRequest,
    GenerateRequest,
    GenerateResponse,
    Info,
    SimpleToken,
    StreamDetails,
    StreamResponse,
    Token,
)
from tgq.api.sse import STREAM_RESPONSES, data_event, dump_json, sse_response
from tgq.api.validation import check_inputs, tgi_params
from tgq.batcher.messages import FinalResult, TokenEvent

router = APIRouter(tags=["Text Generation Inference"])


async def start_generation(
    request: Request,
    body: GenerateRequest,
    *,
    is_stream: bool,
    route: str,
    return_full_text_default: bool = False,
) -> Run:
    """Admit (429 before anything else), validate and tokenize (422), record and enqueue."""
    state = state_of(request)
    generation = state.generation
    with generation.admitted() as ticket:
        check_tgi_fields(body)
        params = tgi_params(
            body.parameters,
            state.settings,
            is_stream=is_stream,
            return_full_text_default=return_full_text_default,
        )
        check_inputs(body.inputs)
        prompts = await generation.validate([body.inputs], params)
        return await generation.start(
            prompts,
            ticket,
            route=route,
            key=request.state.key,
            keep_events=params.top_n_tokens > 0,
        )


async def generate_once(request: Request, body: GenerateRequest, *, route: str) -> Response:
    state = state_of(request)
    default_full_text = route == "/"
    run = await start_generation(
        request, body, is_stream=False, route=route, return_full_text_default=default_full_text
    )
    finals = await state.generation.wait_finals(run, request.receive)
    check_failed(finals)
    answer = generate_response(state, run).model_dump()
    if answer["details"] is None:  # TGI leaves it out
        del answer["details"]
    content = [answer] if route == "/" else answer
    return JSONResponse(content, headers=timing_headers(run, finals, state.settings.compute_type))


async def stream_events(state: AppState, run: Run) -> AsyncIterator[bytes]:
    """One event per token; the last carries `generated_text` (and `details`). A token that may
    be the last is held until the next event shows whether it was."""
    prompt = run.prompts[0]
    params, stopping = prompt.params, prompt.stopping
    held: StreamResponse | None = None
    index = 0
    try:
        async for _, event in state.generation.stream(run):
            if isinstance(event, FinalResult):
                yield _last_event(state, run, event, held, index)
                return
            if held is not None:
                if not event.token_ids:  # text released at the end, after the last token
                    held.token.text += event.text
                    continue
                yield _event(held)
                held = None
            for position, (token_id, logprob) in enumerate(_tokens_of(event)):
                index += 1
                is_last_of_event = position == len(event.token_ids) - 1
                text = event.text if is_last_of_event else ""
                tops = event.top_logprobs[position] if position < len(event.top_logprobs) else []
                response = StreamResponse(
                    index=index,
                    token=token(state, token_id, logprob, text),
                    top_tokens=top_tokens(state, tops),
                )
                may_end = (
                    bool(params.stop_strings)
                    or index >= stopping.max_new_tokens
                    or (token_id in stopping.eos_token_ids and not stopping.ignore_eos)
                )
                if is_last_of_event and may_end:
                    held = response
                else:
                    yield _event(response)
    except ApiError as error:
        yield data_event(dump_json(error_body(error, flavour="tgi")))


def _tokens_of(event: TokenEvent) -> list[tuple[int, float | None]]:
    logprobs = event.logprobs or [None] * len(event.token_ids)
    return list(zip(event.token_ids, logprobs, strict=False))


def _last_event(
    state: AppState, run: Run, final: FinalResult, held: StreamResponse | None, index: int
) -> bytes:
    if final.finish_reason not in ("stop", "length"):
        error = GenerationError(final.finish_detail or final.finish_reason)
        return data_event(dump_json(error_body(error, flavour="tgi")))
    prompt = run.prompts[0]
    last = held or StreamResponse(
        index=index + 1, token=Token(id=0, text="", logprob=None, special=True)
    )
    last.generated_text = tgi_text(state, run, 0, final)
    if prompt.params.details:
        last.details = StreamDetails(
            finish_reason=finish_reason(final),
            generated_tokens=final.num_output_tokens,
            seed=run.requests[0].sampling.seed,
            input_length=prompt.num_prompt_tokens,
        )
    return _event(last)


def _event(response: StreamResponse) -> bytes:
    return data_event(response.model_dump_json(exclude_defaults=False))


async def generate_stream_response(request: Request, body: GenerateRequest, route: str) -> Response:
    state = state_of(request)
    default_full_text = route == "/"
    run = await start_generation(
        request, body, is_stream=True, route=route, return_full_text_default=default_full_text
    )
    headers = {
        "x-compute-type": state.settings.compute_type,
        "x-compute-characters": str(len(body.inputs)),
    }
    return sse_response(stream_events(state, run), headers)


@router.post("/generate", response_model=GenerateResponse)
async def generate(body: GenerateRequest, request: Request) -> Response:
    """Generate tokens."""
    return await generate_once(request, body, route="/generate")


@router.post("/generate_stream", response_class=EventSourceResponse, responses=STREAM_RESPONSES)
async def generate_stream(body: GenerateRequest, request: Request) -> Response:
    """Generate a stream of tokens using Server-Sent Events."""
    return await generate_stream_response(request, body, "/generate_stream")


@router.post("/", response_model=list[GenerateResponse], responses=STREAM_RESPONSES)
async def compat_generate(body: CompatGenerateRequest, request: Request) -> Response:
    """TGI's compatibility route: `stream` picks the streaming or the plain answer."""
    if body.stream:
        return await generate_stream_response(request, body, "/")
    return await generate_once(request, body, route="/")


@router.post("/tokenize", response_model=list[SimpleToken])
async def tokenize(body: GenerateRequest, request: Request) -> list[SimpleToken]:
    """Tokenize the inputs (honours `truncate`; other parameters have no effect here)."""
    state = state_of(request)
    check_tgi_fields(body)
    check_parameter_fields(body.parameters)
    check_inputs(body.inputs)
    tokens = await state.tokenizer.encode_with_offsets(body.inputs)
    truncate = body.parameters.truncate
    if truncate:
        tokens = tokens[-truncate:]
    return [SimpleToken(id=i, text=text, start=start, stop=stop) for i, text, start, stop in tokens]


@router.get("/info", response_model=Info)
async def info(request: Request) -> Info:
    """Model and router limits."""
    state = state_of(request)
    settings = state.settings
    return Info(
        model_id=settings.model_id,
        model_pipeline_tag="text-generation",
        model_dtype=f"torch.{served_dtype(settings)}",
        quantize=state.quantize,
        weight_bytes=next((b.weight_bytes for b in state.beats if b.weight_bytes), None),
        kv_cache_blocks=sum(b.num_usable_blocks for b in state.beats) or None,
        kv_block_size=next((b.kv_block_size for b in state.beats if b.kv_block_size), None),
        max_concurrent_requests=settings.max_concurrent_requests,
        max_best_of=settings.max_best_of,
        max_stop_sequences=settings.max_stop_sequences,
        max_input_tokens=settings.max_input_tokens,
        max_total_tokens=settings.max_total_tokens,
        validation_workers=settings.validation_workers,
        max_client_batch_size=settings.max_client_batch_size,
        router="tgq",
        version=VERSION,
    )


@router.get("/health", response_class=Response)
@router.get("/ping", include_in_schema=False)
@router.get("/", include_in_schema=False)
async def health(request: Request) -> Response:
    """200 when the database answers, Redis is reachable, a batcher is alive and the engine is
    not failing; else 503 naming the problem."""
    state = state_of(request)
    problem = await state.health.check()
    if problem is None:
        return Response(status_code=200)
    body = {"error": f"unhealthy: {problem}", "error_type": "healthcheck"}
    headers = {"Retry-After": str(state.settings.retry_after_s)}
    return JSONResponse(body, status_code=503, headers=headers)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text format, TGI's metric names plus tgq's."""
    state = state_of(request)
    try:
        async with state.db.connect() as conn:
            state.metrics.set_job_counts(await store.count_jobs_by_status(conn))
            state.metrics.set_batch_request_counts(await batches.request_counts_in_progress(conn))
    except Exception:  # the database may be down; the rest of the metrics still matter
        pass
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/api-doc/openapi.json", include_in_schema=False)
async def tgi_openapi(request: Request) -> JSONResponse:
    """The OpenAPI document at TGI's path (FastAPI's own is `/openapi.json`)."""
    return JSONResponse(request.app.openapi())
