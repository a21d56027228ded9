"""The simulator lives in bench/sim/ (not an installed package): make the repository root
importable. Its tests run in simulated time: no sockets, no processes, no sleeps."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
