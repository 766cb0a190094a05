"""``tern up``: the whole stack on one machine, from a fresh clone, with one command.

- :mod:`tern_stack.cli`: the ``tern up`` flags and its entry point (``main``).
- :mod:`tern_stack.up`: the order things start in (:class:`~tern_stack.up.Stack`, :func:`~tern_stack.up.up`).
- :mod:`tern_stack.processes`: child processes, the orphan watchdog and the stop signals.
- :mod:`tern_stack.state`: what is kept under ``.tern/`` between runs (secrets, logs, ``run.json``).
- :mod:`tern_stack.services`: embedded PostgreSQL and Redis (also used by the tests and benchmarks),
  and the free-port helpers.
- :mod:`tern_stack.demo`: the demo tenant and its key; :mod:`tern_stack.banner`: the welcome text.

Importing this package imports nothing else; only :mod:`tern_stack.up` and :mod:`tern_stack.demo`
reach into the gateway, and nothing here imports the engine (the engine runs as a child process).
"""
