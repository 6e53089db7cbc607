"""The api's tiny text model serves the command-line tests too."""

from tests.api.conftest import text_model_dir

__all__ = ["text_model_dir"]
