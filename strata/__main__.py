"""`python -m strata …`: the same as the `strata` command (where the entry point is not installed)."""
from strata.cli import main

raise SystemExit(main())
