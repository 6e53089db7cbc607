"""Chat-template rendering for `/v1/chat/completions`, the way Hugging Face transformers does it.

A chat model ships its prompt format as a Jinja template (`chat_template.jinja`, or the
`chat_template` key of `tokenizer_config.json`). `ChatTemplate` renders OpenAI-style messages into
the prompt string the model was trained on, reproducing `tokenizer.apply_chat_template(...,
tokenize=False)` without importing transformers or torch: the same sandboxed Jinja environment
(`trim_blocks`, `lstrip_blocks`, `loopcontrols`), the same globals (`raise_exception`,
`strftime_now`), the same `tojson` filter, the same variables (`messages`, `tools`, `documents`,
`add_generation_prompt`, the special tokens) and the same message clean-up (keys whose value is
`None` are dropped). Templates are untrusted code from the model repo, so everything that goes
wrong while compiling or rendering one becomes a `ChatTemplateError`, which a request answers with a
422 (`api.chat_prompt`); the client reads its message after TGI's "Template error: ", which the
api's error adds.

`normalize_messages` is the step before: OpenAI content may be a list of parts, while most
templates concatenate `message['content']` as a string, so parts are flattened the way TGI does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The named special tokens transformers passes to every template (its `special_tokens_map`).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
NO_TEMPLATE_MESSAGE = (
    "This model has no chat template: neither chat_template.jinja nor a `chat_template` in "
    "tokenizer_config.json; use /v1/completions or /generate with a raw prompt"
)


class ChatTemplateError(Exception):
    """The chat template could not be compiled or rendered (the message says why)."""


class NoChatTemplateError(ChatTemplateError):
    def __init__(self) -> None:
        super().__init__(NO_TEMPLATE_MESSAGE)


class InvalidMessageError(ValueError):
    """A chat message that cannot be turned into template input."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` HTML-escapes `<`, `>`, `&` and `'`, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENVIRONMENT = _make_environment()  # stateless once built; shared by every ChatTemplate


def _describe(exc: Exception) -> str:
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"syntax error: {exc.message} (line {exc.lineno})"
    if isinstance(exc, jinja2.TemplateError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _templates_from_config(raw: Any) -> dict[str, str]:
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {str(entry["name"]): str(entry["template"]) for entry in raw}
    return {}


class ChatTemplate:
    """One model's chat template(s), compiled lazily and at most once each."""

    def __init__(
        self, templates: str | Mapping[str, str], *, special_tokens: Mapping[str, str] | None = None
    ) -> None:
        self.templates = {"default": templates} if isinstance(templates, str) else dict(templates)
        if not self.templates:
            raise NoChatTemplateError
        self.special_tokens = dict(special_tokens or {})
        self._compiled: dict[str, jinja2.Template] = {}
        self._reads_tools: dict[str, bool] = {}

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTemplate:
        model_dir = Path(path)
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        # Same precedence as transformers: the .jinja file replaces the config's template(s).
        template_path = model_dir / TEMPLATE_FILE
        if template_path.is_file():
            templates = {"default": template_path.read_text(encoding="utf-8")}
        else:
            templates = _templates_from_config(config.get("chat_template"))
        if not templates:
            raise NoChatTemplateError
        special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None
        }
        return cls(templates, special_tokens=special_tokens)

    def template_name(self, tools: list[dict[str, Any]] | None) -> str:
        """As transformers picks: "tool_use" when tools are passed and it exists, else "default"."""
        if tools is not None and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        names = ", ".join(sorted(self.templates))
        raise ChatTemplateError(
            f"this model has several chat templates and none is named 'default' (found: {names})"
        )

    def uses_tools(self) -> bool:
        """Whether the template picked when tools are passed reads the `tools` variable."""
        name = self.template_name([])
        if name not in self._reads_tools:
            try:
                parsed = _ENVIRONMENT.parse(self.templates[name])
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(_describe(exc)) from exc
            self._reads_tools[name] = "tools" in jinja2.meta.find_undeclared_variables(parsed)
        return self._reads_tools[name]

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt for `messages`; `extra` reaches the template as variables (e.g.
        `enable_thinking`) and overrides the special tokens, as in transformers."""
        template = self._template(self.template_name(tools))
        context: dict[str, Any] = {"documents": None, **self.special_tokens, **extra}
        context.update(
            messages=[_drop_none_values(message) for message in messages],
            tools=tools,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return template.render(context)
        # Whatever a template raises (its own raise_exception, an undefined, the sandbox, a
        # TypeError from `'a' + 1`) is the template's or the request's fault, not the server's.
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError) as exc:
            raise ChatTemplateError(_describe(exc)) from exc

    def _template(self, name: str) -> jinja2.Template:
        if name not in self._compiled:
            try:
                self._compiled[name] = _ENVIRONMENT.from_string(self.templates[name])
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(_describe(exc)) from exc
        return self._compiled[name]


def _drop_none_values(message: dict[str, Any]) -> dict[str, Any]:
    # transformers does this: templates test `message.content is defined`, and a None would
    # render as the literal "None".
    return {key: value for key, value in message.items() if value is not None}


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as templates expect them: `content` one string (text parts joined, an
    image part as `![](url)`, as TGI does), tool-call arguments as objects. Other keys are kept;
    `content` may be null only next to `tool_calls`. The input is not modified."""
    return [_normalize_message(index, message) for index, message in enumerate(messages)]


def _normalize_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message.get("role"), str):
        raise InvalidMessageError(f"{where}: `role` must be a string")
    normalized = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        normalized["content"] = "".join(
            _part_text(f"{where}.content[{i}]", part) for i, part in enumerate(content)
        )
    elif content is None and not message.get("tool_calls"):
        raise InvalidMessageError(f"{where}: `content` may be null only with `tool_calls`")
    elif content is not None and not isinstance(content, str):
        raise InvalidMessageError(f"{where}: `content` must be a string or a list of parts")
    if message.get("tool_calls"):
        normalized["tool_calls"] = [_parse_arguments(call) for call in message["tool_calls"]]
    return normalized


def _part_text(where: str, part: Any) -> str:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, Mapping) else image
        if isinstance(url, str):
            return f"![]({url})"
    raise InvalidMessageError(
        f"{where}: expected {{'type': 'text', 'text': str}} or "
        f"{{'type': 'image_url', 'image_url': {{'url': str}}}}"
    )


def _parse_arguments(call: Any) -> Any:
    # OpenAI sends `function.arguments` as a JSON string; templates (Llama 3.1, Qwen 2.5, ...)
    # write `arguments | tojson` and expect an object, as vLLM also arranges.
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}
