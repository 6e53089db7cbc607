"""The `tgq` command line: `cli.main` parses the arguments, one module per command group does
the work (`cli.batch`)."""

INTERRUPTED = 130  # the exit code a shell reports for a command ended by Ctrl-C


class CommandError(Exception):
    """A usage or server error a command reports as one line on stderr; `tgq` exits 2."""
