"""The one validated-request type: what every route turns its body into at the edge. The rest of
the system (generation, jobs, the transport) sees only this."""

from __future__ import annotations

from dataclasses import dataclass

from tgq.batcher.grammar import GrammarSpec
from tgq.batcher.request import Priority, StoppingParams
from tgq.gpu_worker.plan import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """Parameters checked before tokenization (no token counts needed yet)."""

    sampling: SamplingParams
    max_new_tokens: int | None  # None: whatever `max_total_tokens` leaves
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    truncate: int | None = None  # keep only the last N prompt tokens
    best_of: int = 1
    num_choices: int = 1  # OpenAI `n`: independent samples of the same prompt
    # Presentation, applied by the api to what comes back:
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    include_stop_string: bool = False  # TGI keeps the stop string in `generated_text`
    top_n_tokens: int = 0
    add_special_tokens: bool = True
    # Completions `max_tokens: 0` (with `echo`, to score a prompt): the engine generates one
    # token, which the answer leaves out (text, logprobs and usage).
    score_only: bool = False
    grammar: GrammarSpec | None = None  # structured output: what the output must match
    # Chat tools (`api.tools`): how the output is read for tool calls (None: it is not).
    tool_parser: str | None = None
    parallel_tool_calls: bool = True
    speculate: bool = True  # False: no draft tokens for it (`--speculate`)
    adapter: str | None = None  # the LoRA adapter it runs with (`--lora-adapters`); None: base


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    prompt: str
    prompt_token_ids: list[int]  # after truncation
    params: GenerationParams
    stopping: StoppingParams  # max_new_tokens resolved against max_total_tokens
    priority: Priority = Priority.INTERACTIVE
    deadline: float | None = None  # unix time

    @property
    def sampling(self) -> SamplingParams:
        return self.params.sampling

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
