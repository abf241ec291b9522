"""``python -m bench.throughput``."""

import sys

from bench.throughput.cli import main

sys.exit(main())
