"""``python -m engine.bench``: the serving benchmark (same as ``python -m engine.bench.serving``)."""

from engine.bench.serving import main

raise SystemExit(main())
