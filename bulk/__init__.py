"""Bulk pipelines: OpenAI batches (`batches`), and the Celery app (`celery_app`) with its tasks
(`tasks`)."""
