"""``strategy="ps"``: asynchronous data parallelism through parameter servers.

description.py    the strategy before any worker starts (checks, summary lines)
engine.py         the worker's engine: pull, compute its share, push; state and metrics
options.py        its options (servers, staleness, backup workers, transport, ...)
server.py         a server process: one shard, its optimizer, one thread per worker
staleness.py      clocks, the staleness bound, the histogram (pure bookkeeping)
stale_lr.py       the staleness-aware learning rate of asynchronous pushes
backup.py         synchronous rounds that need only the first N - b pushes
batchnorm.py      BatchNorm's running statistics refused at 2+ workers (why: inside)
sharding.py       parameters over servers, greedily by bytes (pure)
optimizer_spec.py the user's optimizer described as JSON and rebuilt in a server
protocol.py       message headers and packing over gloo point-to-point
shared_memory.py  regions a worker and its servers both map (same host): the tensors
                  of pushes and pulls, with only headers over gloo
worker_buffers.py a worker's parameters and gradients: copied (gloo) or in place (mapped)
client.py         a worker's requests to all servers, bounded waits, clear errors
spawn.py          starting servers, waiting for them, the workers-plus-servers group
jobkeys.py        the few facts shared through the launch store
checkpointing.py  checkpoints written and read by the servers (the engine's mixin)
"""

from paratrain.parallel.ps.client import ParameterServerLost
from paratrain.parallel.ps.description import ParameterServerStrategy
from paratrain.parallel.ps.engine import ParameterServerEngine

__all__ = ["ParameterServerEngine", "ParameterServerLost", "ParameterServerStrategy"]
