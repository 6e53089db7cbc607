"""The api's fixtures (a tiny text model, Postgres databases) serve the bulk tests too."""

from tests.api.conftest import pg_engine, pg_url, text_model_dir

__all__ = ["pg_engine", "pg_url", "text_model_dir"]
