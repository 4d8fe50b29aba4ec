"""Words that follow a count: "1 run", "2 runs", "1 GPU", "0 engines".

`plural` lives in engine/units.py, the formatter module every layer imports (the jobs' plan text
counts in words too, and jobs may not import the console); the console has always imported it
from here.
"""

from __future__ import annotations

from ddtree.engine.units import plural  # noqa: F401
