"""``python -m benchmarks``: see benchmarks/README.md."""

from benchmarks.run import main

raise SystemExit(main())
