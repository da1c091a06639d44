"""`python -m safemoe.check._worker_main CONFIG_JSON`: a worker process of `safemoe check` (see
safemoe.check.worker). A module of its own, so `-m` does not run the already-imported worker
module a second time."""

from safemoe.check.worker import main

raise SystemExit(main())
