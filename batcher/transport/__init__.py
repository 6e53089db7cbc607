"""The queue between the api and the batchers: one contract (`base.py`), two backends."""
