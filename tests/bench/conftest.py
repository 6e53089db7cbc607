"""The api's tiny text model runs in the benchmarks' stack here."""

from tests.api.conftest import text_model_dir

__all__ = ["text_model_dir"]
