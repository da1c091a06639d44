"""`python -m safemoe.check._worker_main CONFIG_JSON`: a worker process of `safemoe check` (see
safemoe.check.worker). A module of its own, so `-m` does not run the already-imported worker
module a second time. The guard matters: a process a case spawns (the ep family's ranks, start
method spawn) imports this module again as `__mp_main__`, and must not become a second worker
reading the jobs on the inherited stdin."""

from safemoe.check.worker import main

if __name__ == "__main__":
    raise SystemExit(main())
