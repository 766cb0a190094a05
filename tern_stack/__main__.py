"""``python -m tern_stack``: the same as ``tern up``."""

import sys

from tern_stack.cli import main

sys.exit(main())
