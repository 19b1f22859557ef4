"""`python -m cohort ...`: the same command line as the `cohort` script."""

from cohort.cli import main

raise SystemExit(main())
