"""``python -m tern_cli ...``: the same as ``tern ...``."""

import sys

from tern_cli.main import main

sys.exit(main())
