"""``python -m lampdist``: the ``lampdist`` command (``torchrun ... -m lampdist demo``)."""

import sys

from .cli import main

sys.exit(main())
