"""`python -m zarrckpt`: the zarrckpt command (see zarrckpt/_cli/)."""

import sys

from ._cli import main

sys.exit(main())
