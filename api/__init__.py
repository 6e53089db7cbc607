"""HTTP frontend (TGI- and OpenAI-compatible routes, jobs). Never imports torch."""
