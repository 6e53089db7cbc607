"""`python -m cli`: the same as the `tgq` script."""

import sys

from cli.main import main

sys.exit(main())
