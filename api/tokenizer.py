"""The api's tokenizer: a model's `tokenizer.json` (Hugging Face `tokenizers`), its chat template
and its end-of-sequence ids, used off the event loop on a small thread pool (`validation_workers`,
TGI's name), so tokenizing a long prompt never stalls other requests. A short text is encoded on
the event loop itself (`INLINE_CHARS`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from tokenizers import Tokenizer

from tgq.api.chat_template import ChatTemplate, NoChatTemplateError
from tgq.gpu_worker.config import model_eos_token_ids  # torch-free: it reads config.json

T = TypeVar("T")
TOKENIZER_FILE = "tokenizer.json"
# Texts up to this many characters are encoded on the event loop: ~0.1 ms (840 characters, 143
# tokens; Intel Xeon, `tokenizers`), less than the hand-off to the pool and back, which took 1-2
# ms of a stream's time to first token while the engine's threads held the cores. Longer texts
# (2 ms at 13,000 characters) go to the pool.
INLINE_CHARS = 1024


class ModelTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        chat_template: ChatTemplate | None = None,
        max_workers: int = 2,
        on_call: Callable[[], None] = lambda: None,  # counts the calls (a metric)
    ) -> None:
        self._tokenizer = tokenizer
        self._on_call = on_call
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="tokenizer")

    @classmethod
    def from_model_dir(
        cls, path: str | Path, *, max_workers: int = 2, on_call: Callable[[], None] = lambda: None
    ) -> ModelTokenizer:
        model_dir = Path(path)
        tokenizer_path = model_dir / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise FileNotFoundError(
                f"{tokenizer_path} not found: the api needs the model's tokenizer"
            )
        try:
            chat_template: ChatTemplate | None = ChatTemplate.from_model_dir(model_dir)
        except NoChatTemplateError:
            chat_template = None
        config = model_dir / "config.json"
        eos = model_eos_token_ids(model_dir) if config.is_file() else frozenset()
        return cls(
            Tokenizer.from_file(str(tokenizer_path)),
            eos_token_ids=eos,
            chat_template=chat_template,
            max_workers=max_workers,
            on_call=on_call,
        )

    async def run(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs `call` on the tokenizer pool (for CPU work such as rendering a chat template)."""
        self._on_call()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(call, *args, **kwargs))

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= INLINE_CHARS:
            self._on_call()
            return self.encode_sync(text, add_special_tokens=add_special_tokens)
        return await self.run(self.encode_sync, text, add_special_tokens=add_special_tokens)

    async def encode_with_offsets(
        self, text: str, *, add_special_tokens: bool = True
    ) -> list[tuple[int, str, int, int]]:
        """(id, token text, start, stop) per token; offsets are character offsets into `text`."""
        encoding = await self.run(
            self._tokenizer.encode, text, add_special_tokens=add_special_tokens
        )
        return [
            (token_id, text[start:stop], start, stop)
            for token_id, (start, stop) in zip(encoding.ids, encoding.offsets, strict=True)
        ]

    def encode_sync(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @property
    def vocab_size(self) -> int:
        """Ids below this are tokens (added tokens included)."""
        size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        return size

    def token_text(self, token_id: int) -> str:
        """One token's own text, as TGI reports it in `details.tokens[].text`."""
        return self.decode([token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
