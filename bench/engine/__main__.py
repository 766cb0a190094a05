"""``python -m bench.engine``: the serving benchmark (same as ``python -m bench.engine.serving``)."""

from bench.engine.serving import main

raise SystemExit(main())
