"""`python -m strata …`: the `strata` command (where its entry point is not installed)."""
from strata.cli import main

raise SystemExit(main())
