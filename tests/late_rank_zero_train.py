"""``paratrain train`` for ``torchrun`` with rank 0 a second and a half behind the others.

Used by tests/test_torchrun.py: on a loaded machine rank 0 reached its refusal of bad
input after rank 1 had refused and exited, torchrun stopped rank 0 before it printed,
and the user saw no sentence of ours. A test cannot wait for that load; a sleep before
rank 0 starts makes the order certain.
"""

from __future__ import annotations

import os
import sys
import time

LAG_S = 1.5

if __name__ == "__main__":
    if os.environ.get("RANK") == "0":
        time.sleep(LAG_S)
    from paratrain.cli import main

    sys.exit(main(sys.argv[1:]))
