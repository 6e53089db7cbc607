"""`python -m tgq.cli`: the same as the `tgq` script."""

import sys

from tgq.cli.main import main

sys.exit(main())
