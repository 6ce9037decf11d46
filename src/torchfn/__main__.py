"""``python -m torchfn``: the ``torchfn`` console command (``torchfn.cli``)."""

import sys

from torchfn.cli import main

sys.exit(main())
