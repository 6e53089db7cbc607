"""HTTP api: TGI-compatible and OpenAI-compatible routes, durable jobs. Never imports torch."""
