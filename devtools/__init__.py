"""Development tools: random-weight checkpoints in Hugging Face format for tests, benchmarks and
examples (no model hub is reachable here)."""
