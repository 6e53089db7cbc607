"""Chat templates render exactly what transformers' `apply_chat_template(tokenize=False)` renders,
for real-world templates written out below, and fail with exact reasons (which a request answers
after "Template error: ", test_chat_prompt.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from tgq.api.chat_template import (
    NO_TEMPLATE_MESSAGE,
    ChatTemplate,
    ChatTemplateError,
    InvalidMessageError,
    NoChatTemplateError,
    normalize_messages,
)
from tgq.devtools.tokenizer import train_tokenizer

# Qwen2-Instruct (ChatML).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Meta-Llama-3-8B-Instruct.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# Llama-2-chat: [INST] with an optional <<SYS>> block and enforced role alternation.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# Mistral-7B-Instruct-v0.1: no system role at all.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)

# HuggingFaceH4/zephyr-7b-beta: one tag per line, so it relies on trim_blocks.
ZEPHYR = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
)

# Qwen2.5-Instruct: tools, tool calls and tool responses; indented with `{%-`.
QWEN25_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. \
You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) \
or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TEMPLATES = {
    "chatml": CHATML,
    "llama3": LLAMA3,
    "llama2": LLAMA2,
    "mistral": MISTRAL,
    "zephyr": ZEPHYR,
    "qwen25": QWEN25_TOOLS,
}

Messages = list[dict[str, Any]]
CONVERSATIONS: dict[str, Messages] = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  Name a prime.  "},
    ],
    "multi-turn": [
        {"role": "system", "content": "Réponds en français. ✓"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And <3*3>?"},
    ],
    "ends-with-assistant": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
    ],
    "not-alternating": [
        {"role": "user", "content": "One"},
        {"role": "user", "content": "Two"},
    ],
}

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city (°C)",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_CONVERSATION: Messages = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer")) / "tokenizer.json"


def write_model_dir(
    root: Path, tokenizer_json: Path, chat_template: str | list[dict[str, str]] | None
) -> Path:
    """A model dir as the hub ships it; bos as a Llama-2 style AddedToken dict."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_json, root / "tokenizer.json")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "special": True},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return root


def hf_render(model_dir: Path, messages: Messages, **kwargs: Any) -> str:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    rendered: str = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return rendered


def assert_same_as_transformers(model_dir: Path, messages: Messages, **kwargs: Any) -> None:
    """Either both render the same prompt, or both fail with the same template message."""
    ours = ChatTemplate.from_model_dir(model_dir)
    try:
        expected = hf_render(model_dir, messages, **kwargs)
    except jinja2.TemplateError as exc:
        with pytest.raises(ChatTemplateError) as raised:
            ours.render(messages, **kwargs)
        assert str(raised.value) == str(exc)
        return
    assert ours.render(messages, **kwargs) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_render_matches_transformers(
    tmp_path: Path,
    tokenizer_json: Path,
    template: str,
    conversation: str,
    add_generation_prompt: bool,
) -> None:
    model_dir = write_model_dir(tmp_path, tokenizer_json, TEMPLATES[template])
    assert_same_as_transformers(
        model_dir, CONVERSATIONS[conversation], add_generation_prompt=add_generation_prompt
    )


def test_known_prompts(tmp_path: Path, tokenizer_json: Path) -> None:
    # Pinned by hand too, so a change in transformers cannot move both sides at once.
    messages = CONVERSATIONS["system"]
    llama3 = ChatTemplate.from_model_dir(write_model_dir(tmp_path / "l3", tokenizer_json, LLAMA3))
    assert llama3.render(messages) == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nName a prime.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    zephyr = ChatTemplate.from_model_dir(write_model_dir(tmp_path / "z", tokenizer_json, ZEPHYR))
    assert zephyr.render(messages) == (
        "<|system|>\nYou are terse.</s>\n<|user|>\n  Name a prime.  </s>\n<|assistant|>\n"
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tools_and_tool_calls_match_transformers(
    tmp_path: Path, tokenizer_json: Path, add_generation_prompt: bool
) -> None:
    model_dir = write_model_dir(tmp_path, tokenizer_json, QWEN25_TOOLS)
    messages = normalize_messages(TOOL_CONVERSATION)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Zürich"}
    assert_same_as_transformers(
        model_dir, messages, tools=[WEATHER_TOOL], add_generation_prompt=add_generation_prompt
    )
    rendered = ChatTemplate.from_model_dir(model_dir).render(messages, tools=[WEATHER_TOOL])
    assert '"description": "Current weather in a city (°C)"' in rendered  # not \u00b0
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in rendered


def test_extra_variables_reach_the_template_and_override_special_tokens(
    tmp_path: Path, tokenizer_json: Path
) -> None:
    source = "{{ bos_token }}{% if enable_thinking %}<think>{% endif %}{{ messages[0].content }}"
    model_dir = write_model_dir(tmp_path, tokenizer_json, source)
    messages = CONVERSATIONS["user"]
    template = ChatTemplate.from_model_dir(model_dir)
    assert template.render(messages, enable_thinking=True) == "<s><think>Hello!"
    assert template.render(messages, bos_token="[B]") == "[B]Hello!"
    assert_same_as_transformers(model_dir, messages, enable_thinking=True, bos_token="[B]")


def test_tojson_options_and_strftime_now(tmp_path: Path, tokenizer_json: Path) -> None:
    source = (
        "{{ tools | tojson(indent=2, sort_keys=true) }}|{{ {'a': 1, 'b': '<é>'} | tojson"
        "(separators=(',', ':')) }}|{{ strftime_now('%Y') | length }}"
    )
    model_dir = write_model_dir(tmp_path, tokenizer_json, source)
    tools: list[dict[str, Any]] = [{"z": 1, "a": "ü"}]
    rendered = ChatTemplate.from_model_dir(model_dir).render([], tools=tools)
    assert rendered == '[\n  {\n    "a": "ü",\n    "z": 1\n  }\n]|{"a":1,"b":"<é>"}|4'


def test_jinja_file_takes_precedence_over_config(tmp_path: Path, tokenizer_json: Path) -> None:
    model_dir = write_model_dir(tmp_path, tokenizer_json, CHATML)
    (model_dir / "chat_template.jinja").write_text(ZEPHYR, encoding="utf-8")
    messages = CONVERSATIONS["system"]
    rendered = ChatTemplate.from_model_dir(model_dir).render(messages)
    assert rendered.startswith("<|system|>\n")
    assert rendered == hf_render(model_dir, messages, add_generation_prompt=True)


def test_jinja_file_alone_needs_no_config(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    rendered = ChatTemplate.from_model_dir(tmp_path).render(CONVERSATIONS["user"])
    assert rendered.endswith("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")


def test_list_form_selects_tool_use_only_with_tools(tmp_path: Path, tokenizer_json: Path) -> None:
    templates = [
        {"name": "default", "template": "plain:{{ messages | length }}"},
        {"name": "tool_use", "template": "tools:{{ tools | map(attribute='type') | join(',') }}"},
    ]
    model_dir = write_model_dir(tmp_path, tokenizer_json, templates)
    template = ChatTemplate.from_model_dir(model_dir)
    messages = CONVERSATIONS["user"]
    assert template.render(messages) == "plain:1"
    assert template.render(messages, tools=[WEATHER_TOOL]) == "tools:function"
    assert template.render(messages, tools=[WEATHER_TOOL]) == hf_render(
        model_dir, messages, tools=[WEATHER_TOOL]
    )


def test_list_form_without_tool_use_uses_default_with_tools(
    tmp_path: Path, tokenizer_json: Path
) -> None:
    templates = [{"name": "default", "template": "{{ tools | length }} tools"}]
    model_dir = write_model_dir(tmp_path, tokenizer_json, templates)
    rendered = ChatTemplate.from_model_dir(model_dir).render([], tools=[WEATHER_TOOL])
    assert rendered == "1 tools"


def test_list_form_without_default(tmp_path: Path, tokenizer_json: Path) -> None:
    templates = [{"name": "rag", "template": "r"}, {"name": "tool_use", "template": "t"}]
    template = ChatTemplate.from_model_dir(write_model_dir(tmp_path, tokenizer_json, templates))
    assert template.render([], tools=[WEATHER_TOOL]) == "t"
    with pytest.raises(ChatTemplateError) as raised:
        template.render([])
    assert str(raised.value) == (
        "this model has several chat templates and none is named 'default' (found: rag, tool_use)"
    )


def test_special_tokens_come_from_config(tmp_path: Path, tokenizer_json: Path) -> None:
    model_dir = write_model_dir(tmp_path, tokenizer_json, CHATML)
    template = ChatTemplate.from_model_dir(model_dir)
    assert template.special_tokens == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
    }


def test_no_template(tmp_path: Path, tokenizer_json: Path) -> None:
    model_dir = write_model_dir(tmp_path, tokenizer_json, None)
    with pytest.raises(NoChatTemplateError) as raised:
        ChatTemplate.from_model_dir(model_dir)
    assert str(raised.value) == (
        "This model has no chat template: neither chat_template.jinja nor a `chat_template` in "
        "tokenizer_config.json; use /v1/completions or /generate with a raw prompt"
    )
    assert str(raised.value) == NO_TEMPLATE_MESSAGE
    assert isinstance(raised.value, ChatTemplateError)
    with pytest.raises(NoChatTemplateError):
        ChatTemplate.from_model_dir(tmp_path / "empty")


def test_raise_exception_message(tmp_path: Path, tokenizer_json: Path) -> None:
    model_dir = write_model_dir(tmp_path, tokenizer_json, MISTRAL)
    template = ChatTemplate.from_model_dir(model_dir)
    with pytest.raises(ChatTemplateError) as raised:
        template.render([{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be"}])
    assert str(raised.value) == "Only user and assistant roles are supported!"
    with pytest.raises(ChatTemplateError) as raised:
        template.render(CONVERSATIONS["not-alternating"])
    assert str(raised.value) == (
        "Conversation roles must alternate user/assistant/user/assistant/..."
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "{{ ''.__class__.__mro__ }}",
            "access to attribute '__class__' of 'str' object is unsafe.",
        ),
        (
            "{{ messages.append(1) }}",
            "access to attribute 'append' of 'list' object is unsafe.",
        ),
        (
            "{{ raise_exception.__globals__['os'] }}",
            "access to attribute '__globals__' of 'function' object is unsafe.",
        ),
    ],
)
def test_sandbox_blocks_escapes(source: str, message: str) -> None:
    with pytest.raises(ChatTemplateError) as raised:
        ChatTemplate(source).render(CONVERSATIONS["user"])
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "{% for message in messages %}{{ message.content }}",
            "syntax error: Unexpected end of template. Jinja was looking for the "
            "following tags: 'endfor' or 'else'. The innermost block that needs to be closed is "
            "'for'. (line 1)",
        ),
        ("{{ nothing.here }}", "'nothing' is undefined"),
        (
            "{{ messages[0].content + 1 }}",
            'TypeError: can only concatenate str (not "int") to str',
        ),
    ],
)
def test_template_errors(source: str, message: str) -> None:
    template = ChatTemplate(source)
    for _ in range(2):  # a broken template keeps failing the same way
        with pytest.raises(ChatTemplateError) as raised:
            template.render(CONVERSATIONS["user"])
        assert str(raised.value) == message


def test_compiles_once(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    from_string = jinja2.Environment.from_string

    def counting(env: jinja2.Environment, source: str, *args: Any, **kwargs: Any) -> Any:
        compiled.append(source)
        return from_string(env, source, *args, **kwargs)

    monkeypatch.setattr(jinja2.Environment, "from_string", counting)
    template = ChatTemplate(CHATML)
    for conversation in CONVERSATIONS.values():
        template.render(conversation)
    assert compiled == [CHATML]


def test_normalize_flattens_parts_and_images() -> None:
    messages: Messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "name": "ada",
            "content": [
                {"type": "text", "text": "What is in "},
                {"type": "image_url", "image_url": {"url": "https://x.test/cat.png"}},
                {"type": "text", "text": "?"},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "ok"}]},
    ]
    original = json.loads(json.dumps(messages))
    assert normalize_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "name": "ada", "content": "What is in ![](https://x.test/cat.png)?"},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    assert messages == original


def test_normalize_keeps_null_content_with_tool_calls() -> None:
    normalized = normalize_messages(TOOL_CONVERSATION)
    assert normalized[1]["content"] is None
    assert normalized[1]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
        }
    ]
    assert TOOL_CONVERSATION[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'


def test_normalize_leaves_unparseable_arguments() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    assert normalize_messages([message]) == [message]


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"content": "hi"}, "messages[0]: `role` must be a string"),
        (
            {"role": "user", "content": None},
            "messages[0]: `content` may be null only with `tool_calls`",
        ),
        ({"role": "user"}, "messages[0]: `content` may be null only with `tool_calls`"),
        (
            {"role": "user", "content": 3},
            "messages[0]: `content` must be a string or a list of parts",
        ),
        (
            {"role": "user", "content": [{"type": "audio", "audio": "..."}]},
            "messages[0].content[0]: expected {'type': 'text', 'text': str} or "
            "{'type': 'image_url', 'image_url': {'url': str}}",
        ),
    ],
)
def test_normalize_rejects(message: dict[str, Any], error: str) -> None:
    with pytest.raises(InvalidMessageError) as raised:
        normalize_messages([message])
    assert str(raised.value) == error
