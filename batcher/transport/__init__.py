"""The queue between the api and the batchers: one contract (`base.Transport`), two backends."""
