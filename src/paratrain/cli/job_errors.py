"""A user's error said once under torchrun, and said at all.

Under torchrun every rank runs the command and refuses bad input alike, so only global
rank 0 prints the sentence. But torchrun stops every worker as soon as one exits with an
error: a rank that refused a moment before rank 0 printed got rank 0 killed by SIGTERM
mid-way, and the user saw torchrun's failure report with no sentence of ours (the CLI
test under torchrun met it on a loaded machine). So a rank other than 0 waits before it
exits, long enough for rank 0 to print and exit first, after which torchrun stops the
waiting ranks; one that outlives the wait met an error rank 0 did not (a file missing on
its node, say) and prints it itself, naming its rank.
"""

from __future__ import annotations

import os
import sys
import time

from paratrain.runtime.external_job import in_external_job, is_main_process

RANK_ZERO_GRACE_S = 5.0
"""How long another rank gives rank 0 to print and exit: torchrun notices a worker's
exit within a tenth of a second, and rank 0 lagged by more than that under load."""


def say_error_once(error: object) -> None:
    """Print ``paratrain: error: <error>`` to stderr as the command's one sentence (see
    the module doc): at once on rank 0 or outside a job, else after the wait."""
    if is_main_process() or not in_external_job():
        print(f"paratrain: error: {error}", file=sys.stderr)
        return
    time.sleep(RANK_ZERO_GRACE_S)
    rank = os.environ.get("RANK", "?")
    print(f"paratrain: error (rank {rank}): {error}", file=sys.stderr)
