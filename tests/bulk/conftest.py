"""The api's fixtures (a tiny text model, Postgres databases) serve the bulk tests too."""

from tests.api.conftest import text_model_dir

__all__ = ["text_model_dir"]
