"""Bulk pipelines on Celery: the app (`celery_app`) and its tasks (`tasks`)."""
