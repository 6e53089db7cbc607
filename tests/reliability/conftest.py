"""The fixtures of `tests/api`, re-exported for the reliability tests: the tiny text model
(`text_model_dir`), a session database (`pg_url`) and a module's running stack (`stack`:
Postgres, Redis, a batcher process and the api process)."""

from tests.api.conftest import pg_url, stack, text_model_dir

__all__ = ["pg_url", "stack", "text_model_dir"]
