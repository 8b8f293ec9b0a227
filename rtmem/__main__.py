"""``python -m rtmem``: the same command line as the ``rtmem`` script."""

import sys

from .cli import main

sys.argv[0] = "rtmem"    # usage lines name the command, not __main__.py
sys.exit(main())
