"""``python -m router.cli ...``: the same as the ``pdcluster`` console script."""

import sys

from router.cli.main import main

sys.exit(main())
