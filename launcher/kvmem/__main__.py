from __future__ import annotations

import sys

from kvmem.cli import main

sys.exit(main())
