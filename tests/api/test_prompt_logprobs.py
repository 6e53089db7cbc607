"""Prompt logprobs through HTTP on the real stack (started with --enable-prefill-logprobs): TGI's
`decoder_input_details` and OpenAI completions `echo` with `logprobs` score every prompt token as
transformers' log_softmax does, within 1e-4 (the test model runs in fp32), also when the prompt
was just served from the prefix cache."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from tests.api.stack import Stack

pytestmark = pytest.mark.timeout(300)
TOLERANCE = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog and then reads the Python documentation"


def reference(model_dir: Path, token_ids: list[int]) -> tuple[list[float], list[int]]:
    """transformers' log_softmax over one forward of the prompt: each token after the first,
    scored after the tokens before it; and the most likely id at each of those positions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    scores = torch.log_softmax(logits, dim=-1)
    chosen = scores.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return chosen.tolist(), scores.argmax(dim=-1).tolist()


def test_tgi_prefill_and_openai_echo_score_the_prompt_as_transformers(
    stack: Stack, text_model_dir: Path
) -> None:
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        plain = http.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        assert plain.status_code == 200  # the prompt's blocks are in the prefix cache now
        tgi = http.post(
            "/generate",
            json={
                "inputs": PROMPT,
                "parameters": {"max_new_tokens": 2, "decoder_input_details": True},
            },
        )
        completion = http.post(
            "/v1/completions",
            json={
                "model": "tgq-test",
                "prompt": PROMPT,
                "max_tokens": 1,
                "echo": True,
                "logprobs": 1,
                "temperature": 0,
            },
        )
    assert tgi.status_code == 200, tgi.text
    prefill = tgi.json()["details"]["prefill"]
    token_ids = [token["id"] for token in prefill]
    expected, argmax = reference(text_model_dir, token_ids)
    assert len(token_ids) > 8 and prefill[0]["logprob"] is None
    torch.testing.assert_close(
        torch.tensor([token["logprob"] for token in prefill[1:]]),
        torch.tensor(expected),
        atol=TOLERANCE,
        rtol=0,
    )
    assert completion.status_code == 200, completion.text
    logprobs = completion.json()["choices"][0]["logprobs"]
    count = len(token_ids)  # the echoed prompt's tokens, then the one generated
    assert len(logprobs["tokens"]) == count + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    torch.testing.assert_close(
        torch.tensor(logprobs["token_logprobs"][1:count]),
        torch.tensor(expected),
        atol=TOLERANCE,
        rtol=0,
    )
    # logprobs=1: each prompt position's most likely token, as lm-eval reads it (is_greedy)
    tops = logprobs["top_logprobs"][1:count]
    assert all(len(top) == 1 for top in tops)
    for position, (top, chosen, best) in enumerate(zip(tops, expected, argmax, strict=True)):
        (best_logprob,) = top.values()
        assert best_logprob >= chosen - TOLERANCE
        if best == token_ids[position + 1]:  # the prompt's token is the model's first choice
            assert abs(best_logprob - chosen) <= TOLERANCE


def test_a_prompt_of_token_ids_is_scored_as_its_text(stack: Stack) -> None:
    """lm-eval's `local-completions` sends token ids (`prompt: [[...]]`), `echo`, `logprobs: 1`
    and `max_tokens: 1`: the ids are scored as they are; an id outside the vocabulary is a 422
    naming it."""
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        details = {"max_new_tokens": 1, "decoder_input_details": True}
        tgi = http.post("/generate", json={"inputs": PROMPT, "parameters": details}).json()
        token_ids = [token["id"] for token in tgi["details"]["prefill"]]
        body = {"model": "tgq-test", "max_tokens": 1, "echo": True, "logprobs": 1}
        by_ids = http.post("/v1/completions", json={**body, "prompt": [token_ids]})
        bad = http.post("/v1/completions", json={**body, "prompt": [3, 10**6]})
    assert by_ids.status_code == 200, by_ids.text
    choice = by_ids.json()["choices"][0]
    scored = choice["logprobs"]["token_logprobs"][: len(token_ids)]
    assert scored[0] is None
    torch.testing.assert_close(
        torch.tensor(scored[1:]),
        torch.tensor([token["logprob"] for token in tgi["details"]["prefill"][1:]]),
        atol=TOLERANCE,
        rtol=0,
    )
    assert choice["text"].startswith(PROMPT)  # echo: the ids' text
    assert bad.status_code == 422
    assert bad.json()["error"]["message"].startswith("token id 1000000 in `prompt` is not in")


def test_max_tokens_zero_scores_the_prompt_only(stack: Stack) -> None:
    """`max_tokens: 0` with `echo` (OpenAI's way to score a text): the prompt and its logprobs
    come back, nothing generated, no completion tokens; streaming it is a 422."""
    body = {"model": "tgq-test", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0}
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        scored = http.post("/v1/completions", json=body)
        streamed = http.post("/v1/completions", json={**body, "stream": True})
        tgi = http.post(
            "/generate",
            json={
                "inputs": PROMPT,
                "parameters": {"max_new_tokens": 1, "decoder_input_details": True},
            },
        ).json()
    assert scored.status_code == 200, scored.text
    answer = scored.json()
    choice = answer["choices"][0]
    prefill = tgi["details"]["prefill"]
    assert (choice["text"], choice["finish_reason"]) == (PROMPT, "length")
    assert len(choice["logprobs"]["tokens"]) == len(prefill)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [token["logprob"] for token in prefill[1:]], abs=TOLERANCE
    )
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == len(prefill)
    assert streamed.status_code == 422
    assert streamed.json()["error"]["message"] == (
        "`max_tokens` 0 (score the prompt only) is not supported when streaming"
    )


def test_vllm_prompt_logprobs(stack: Stack) -> None:
    """vLLM's `prompt_logprobs: k` on completions: per prompt position (null first), the prompt's
    token with its logprob (as TGI's prefill) and rank, and the k most likely tokens ranked 1..k;
    out of range, a 422 naming it."""
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        details = {"max_new_tokens": 1, "decoder_input_details": True}
        tgi = http.post("/generate", json={"inputs": PROMPT, "parameters": details}).json()
        body = {"model": "tgq-test", "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2}
        answer = http.post("/v1/completions", json=body)
        bad = http.post("/v1/completions", json={**body, "prompt_logprobs": 9})
    assert answer.status_code == 200, answer.text
    entries = answer.json()["choices"][0]["prompt_logprobs"]
    prefill = tgi["details"]["prefill"]
    assert len(entries) == len(prefill) and entries[0] is None
    for entry, token in zip(entries[1:], prefill[1:], strict=True):
        mine = entry[str(token["id"])]
        assert mine["logprob"] == pytest.approx(token["logprob"], abs=TOLERANCE)
        assert mine["decoded_token"] == token["text"]
        by_rank = {e["rank"]: e for e in entry.values()}
        assert by_rank[1]["logprob"] >= by_rank[2]["logprob"]  # the top 2, ranked 1 and 2
        if mine["rank"] > 2:  # the prompt's token past them: an entry of its own, less likely
            assert len(entry) == 3 and mine["logprob"] <= by_rank[2]["logprob"] + TOLERANCE
    assert bad.status_code == 422
    assert bad.json()["error"]["message"] == "`prompt_logprobs` must be >= 0 and <= 5. Given: 9"


def test_vllm_prompt_logprobs_on_chat(stack: Stack, text_model_dir: Path) -> None:
    """vLLM's `prompt_logprobs` on chat completions: the rendered prompt's tokens (as
    transformers' chat template renders them), each scored as transformers' log_softmax within
    1e-4, once for all the choices, beside them; off by default."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": "tgq-test", "messages": messages, "max_tokens": 2, "n": 2}
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        answer = http.post("/v1/chat/completions", json={**body, "prompt_logprobs": 0})
        plain = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert "prompt_logprobs" not in plain.json()
    result = answer.json()
    entries = result["prompt_logprobs"]
    assert len(result["choices"]) == 2
    assert len(entries) == result["usage"]["prompt_tokens"] and entries[0] is None
    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)
    token_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(token_ids, list):  # transformers 5: a BatchEncoding
        token_ids = token_ids["input_ids"]
    assert [int(next(iter(entry))) for entry in entries[1:]] == token_ids[1:]
    expected, _ = reference(text_model_dir, token_ids)
    ours = [next(iter(entry.values()))["logprob"] for entry in entries[1:]]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(expected), atol=TOLERANCE, rtol=0)
