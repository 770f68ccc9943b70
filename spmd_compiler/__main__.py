"""``python -m spmd_compiler``: see :mod:`spmd_compiler.cli`."""

import sys

from .cli import main

sys.exit(main())
