"""python -m dapple.cli: the dapple command (torchrun -m dapple.cli probe ...)."""

import sys

from . import main

sys.exit(main())
