"""OpenAI's Batches API behind the routes (`api/routes/batches.py`): the driver that takes a
batch from its input file to its output files (`driver`, by phase in `validating`, `window` and
`finalizing`), and where the api process has it run (`starters`)."""
