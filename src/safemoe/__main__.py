"""`python -m safemoe`: the same as the `safemoe` command."""

from safemoe.cli import main

raise SystemExit(main())
