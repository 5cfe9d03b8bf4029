"""``python -m mosaics ...``: the same as the ``mosaics`` command."""

import sys

from .cli import main

sys.exit(main())
