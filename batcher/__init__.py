"""Scheduler process: request state, KV block manager, step loop. Never imports torch."""
