"""``paratrain train`` for ``torchrun`` with rank 1's clock an hour ahead of rank 0's.

Used by tests/test_torchrun.py: ranks that start either side of a second boundary read
different times, which a test cannot wait for; an hour's skew makes every clock-derived
name differ for certain. The clock is replaced where the run folder's default name reads
it (``datetime`` in the module that names it, wherever that module is), so the same
script exercises the code before and after the folder was decided once.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta

import paratrain.run.fit


class _HourAhead(datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ANN001, ANN206 (datetime's own signature)
        return datetime.now(tz) + timedelta(hours=1)


if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        try:
            import paratrain.run.run_folder as named_in
        except ImportError:  # the code before the folder was decided once
            named_in = paratrain.run.fit
        named_in.datetime = _HourAhead
    from paratrain.cli import main

    sys.exit(main(sys.argv[1:]))
