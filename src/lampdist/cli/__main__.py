"""``python -m lampdist.cli``: the ``lampdist`` command (``torchrun ... -m lampdist.cli demo``)."""

import sys

from . import main

sys.exit(main())
