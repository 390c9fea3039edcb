"""``strategy="ps"``: asynchronous data parallelism through parameter servers.

N worker processes compute gradients; ``servers`` extra processes hold the parameters and
the optimizer state, split over the servers by bytes. Each step a worker pulls the
current parameters (waiting only as long as the staleness bound says), computes the
gradient of its contiguous share of the global batch (as dp does, with the same
micro-batching), and pushes it; ``train_step`` returns once every server accepted the
push (in a plain synchronous round, once the round closed: see below). A server applies
each push as it arrives (``staleness`` >= 1 or None), or, with ``staleness=0``, averages
one push from every live worker per version and takes one optimizer step, which makes
the run equal to the single-device engine. With ``staleness=0, backup_workers=b`` a
version takes the first N - b pushes computed on it and folds the late ones into the
next (see ``backup``): synchronous steps, no waiting for the slowest worker.

``StepStats.loss`` with ``staleness=0`` and no backup workers is the global batch's mean
loss, as under dp: each push carries its share's loss, the servers add the round's up,
and they answer a push once its round has closed, with the mean. The worker's wait for
the round thus moves from its next pull (which then finds the round closed) to the end of
its push, and is no longer. Under asynchrony some things mean something narrower than
under dp, on purpose (no worker may wait on another): ``StepStats.loss`` is the mean loss
of this worker's share, and so it is with backup workers, whose versions are not one
global batch's (late shares fold into the next version; waiting for them is what backup
workers avoid). ``StepStats.samples`` is always the size of this worker's share (the
trainer adds the workers' rates up).
``eval_step`` and ``state_dict`` read the servers' current parameters, which other workers
may be changing at that moment. Buffers (none in the reference models) stay per worker;
BatchNorm's running statistics would then differ from worker to worker, so a model with
them is refused at more than one worker (``batchnorm``).

Mixed precision: workers run forwards under the ``Precision``'s autocast (bf16 or fp16);
parameters, pushed gradients and the servers' optimizer state stay fp32. Under fp16 each
worker scales its own loss, then unscales and checks its own gradients with no message
(no worker may wait on another), so each worker has its own loss scale. A worker whose
gradients overflowed pushes no gradient, only the fact that it took the step (see
``protocol.py``): the servers never see inf/NaN, and a synchronous round does not wait for
a gradient that will not come. How a round averages then is in ``server.py`` (over the
pushes that carried gradients). ``StepStats.skipped_steps`` and ``loss_scale`` are this
worker's; ``ps_metrics()["skipped_pushes"]`` counts every worker's.

Clipping (``max_grad_norm``): a synchronous round's mean gradient is clipped by its global
norm, which the servers add up from their shards' squared norms, as ``clip_grad_norm_`` on
one device; under asynchrony each push, a step of its own, is clipped by its worker by its
own norm; with backup workers clipping is refused. ``StepStats.grad_norm`` is the round's
norm before clipping, or under asynchrony this worker's push's. See ``clipping``.

The engine never uses the job's default process group, so a worker that dies hangs
nobody: the servers retire it and, with ``paratrain.launch``, the run goes on without it.
Under torchrun there is no launch store and nobody to tolerate a lost worker, so the
strategy is refused there.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
from torch import nn

from paratrain.parallel.batching import (
    batch_size,
    check_divisible,
    split_micro,
    take_share,
    to_device,
)
from paratrain.parallel.clipping import clip_local
from paratrain.parallel.inputs import call_model
from paratrain.parallel.layout import Layout
from paratrain.parallel.loss_reduction import LossTotals, loss_value
from paratrain.parallel.model_loss_items import part_inputs, with_num_items
from paratrain.parallel.ps import jobkeys, spawn
from paratrain.parallel.ps.backup import check_backup_workers
from paratrain.parallel.ps.batchnorm import check_batchnorm
from paratrain.parallel.ps.checkpointing import ServerCheckpoints
from paratrain.parallel.ps.client import ServerLink
from paratrain.parallel.ps.clipping import check_clipping
from paratrain.parallel.ps.optimizer_spec import describe_optimizer
from paratrain.parallel.ps.protocol import GRAD_NORM_FIELD, ROUND_LOSS_FIELD, Op, ShardLayout
from paratrain.parallel.ps.sharding import ParamSpec, assign_shards, check_servers
from paratrain.parallel.ps.shared_memory import SharedRegion, resolve_transport
from paratrain.parallel.ps.stale_lr import check_policy
from paratrain.parallel.ps.staleness import check_bound
from paratrain.parallel.ps.worker_buffers import CopiedBuffers, MappedBuffers
from paratrain.parallel.replica_rng import separate_streams
from paratrain.parallel.single import canonical_state
from paratrain.parallel.strategy import (
    Engine,
    StepStats,
    optimizer_from_factory,
)
from paratrain.runtime import comm
from paratrain.runtime.launch import in_external_job, tolerate_lost_workers

_engines = itertools.count()  # every worker builds its engines in the same order


def check_straggler(straggler: object, workers: int) -> dict[str, Any] | None:
    """Refuse a straggler setting that is not ``{"rank": r, "slowdown": s}`` (s >= 1)."""
    if straggler is None:
        return None
    if not isinstance(straggler, dict) or set(straggler) != {"rank", "slowdown"}:
        raise ValueError(
            f"straggler must be a dict {{'rank': worker, 'slowdown': factor}}, not {straggler!r}."
        )
    rank, slowdown = straggler["rank"], straggler["slowdown"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < workers:
        raise ValueError(f"straggler rank must be a worker rank in 0..{workers - 1}, not {rank!r}.")
    if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or slowdown < 1:
        raise ValueError(f"straggler slowdown must be a number >= 1, not {slowdown!r}.")
    return {"rank": rank, "slowdown": float(slowdown)}


def require_launch() -> None:
    """Refuse to run outside paratrain.launch (torchrun, or a plain process), saying why."""
    if in_external_job():
        raise RuntimeError(
            "strategy 'ps' is not supported under torchrun/Slurm: it starts its server "
            "processes on this machine and relies on paratrain.launch to keep the run going "
            "when a worker dies; start it with paratrain.launch (or `paratrain train`), or "
            "use strategy 'dp' under torchrun."
        )
    if not comm.distributed():
        raise RuntimeError(
            "strategy 'ps' needs worker processes: call paratrain.setup inside a function run "
            "by paratrain.launch(...), or use strategy='single'."
        )


class ParameterServerEngine(ServerCheckpoints, Engine):
    """Workers compute, servers own parameters and optimizer state; bounded staleness.

    Options: ``servers`` (server processes, default 1), ``staleness`` (0 = synchronous,
    k = at most k steps ahead of the slowest live worker, None = asynchronous),
    ``staleness_lr`` ("inverse", the default: a push's learning rate is divided by its
    staleness + 1, see ``stale_lr``; "constant": every push at the optimizer's rate),
    ``backup_workers`` (with ``staleness=0`` only: a version closes on its first N - b
    fresh pushes, late pushes are folded into the next at the ``staleness_lr`` factor; see
    ``backup``),
    ``lookahead`` (True, the default: under asynchrony a step's pull returns the parameters
    extrapolated to where they will be when its push lands; see ``lookahead``),
    ``straggler`` (``{"rank": r, "slowdown": s}``: worker r sleeps (s - 1) times its
    compute time each step, between its pull and its compute; for tests and benchmarks),
    ``transport`` ("auto", the default:
    "shared_memory" where the host has ``/dev/shm``, else "gloo"; how pushed gradients and
    pulled parameters travel, see ``shared_memory``), ``timeout_s`` (the longest any
    wait on a server may last). ``precision`` is "fp32", "bf16", "fp16" or a ``Precision``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layout: Layout,
        servers: int = 1,
        staleness: int | None = 0,
        staleness_lr: str = "inverse",
        backup_workers: int = 0,
        lookahead: bool = True,
        straggler: dict[str, Any] | None = None,
        transport: str = "auto",
        timeout_s: float = 300.0,
        **shared: Any,
    ) -> None:
        """ps's options as above; ``shared``: every engine's (``EngineSettings``)."""
        super().__init__(model, layout=layout, **shared)
        require_launch()
        check_batchnorm(model, comm.world_size())  # on every worker, before any server starts
        self.staleness = check_bound(staleness)
        self.staleness_lr = check_policy(staleness_lr)
        if not isinstance(lookahead, bool):
            raise ValueError(f"lookahead must be True or False, not {lookahead!r}.")
        # Whether step pulls look ahead: synchronous rounds never do (no push is stale).
        self.lookahead = lookahead and self.staleness != 0
        self.transport = resolve_transport(transport)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s!r}.")
        self.timeout_s = float(timeout_s)
        self.model = model.to(self._device)
        self._params = list(self.model.named_parameters())
        specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in self._params]
        self.servers = check_servers(servers, len(specs))
        self._workers, self._rank = comm.world_size(), comm.rank()
        self.straggler = check_straggler(straggler, self._workers)
        self._last_compute_s: float | None = None  # the straggler's sleep is scaled from it
        self.backup_workers = check_backup_workers(backup_workers, self.staleness, self._workers)
        check_clipping(self.max_grad_norm, self.backup_workers)
        shards = assign_shards(specs, self.servers)
        self._layouts = [ShardLayout(shard) for shard in shards]
        by_name = dict(self._params)
        self._shard_params = [[by_name[s.name] for s in shard] for shard in shards]
        # The servers hold the real optimizer; this one is never stepped. It holds the
        # user's parameter groups and hyperparameters, so that a learning-rate scheduler
        # can drive it, and each step sends its rates to the servers where they changed.
        optimizer = self.settings.optimizer
        self.optimizer = optimizer_from_factory(optimizer, self.model.named_parameters())
        self._rates_sent = self._rates()
        self._connect_servers(shards, timeout_s)
        self._versions = [0] * self.servers
        if self.transport == "shared_memory":
            pulls, pushes = self._attach_shared_regions()
            self._buffers = MappedBuffers(self._layouts, self._shard_params, pulls, pushes)
        else:
            self._buffers = CopiedBuffers(self._layouts, self._shard_params)
        self.server_samples = 0
        """Samples whose gradients server 0 had applied at this worker's last push."""
        # The worker's own memory: the model and its gradients (the optimizer state lives
        # on the servers), activations, and the gloo transport's pull and push copies.
        self.memory.watch(
            self.model.parameters(),
            model_state=self.model_state_bytes,
            communication=self._buffers.buffer_bytes,
        )
        self._closed = False
        self._finished = False
        self._claims: dict[str, int] = {}
        if self._rank == 0:
            self._set_parameters()  # the servers start from worker 0's initial parameters
        separate_streams(agree=False)  # each worker its own dropout masks, with no message

    def _connect_servers(self, shards: list[list[ParamSpec]], timeout_s: float) -> None:
        """Worker 0 starts the servers with the run's spec; every worker waits until they
        are ready, joins their group and opens its link to them."""
        self._prefix = f"paratrain/ps/{next(_engines)}"
        self.store = jobkeys.connect(timeout_s=timeout_s)
        self._processes = []
        if self._rank == 0:
            tolerate_lost_workers(self.store)
            spec = {
                "workers": self._workers,
                "servers": self.servers,
                "staleness": self.staleness,
                "staleness_lr": self.staleness_lr,
                "backup_workers": self.backup_workers,
                "lookahead": self.lookahead,
                # Synchronous rounds are clipped by the servers; pushes under asynchrony
                # by their workers (see ``clipping``).
                "max_grad_norm": self.max_grad_norm if self.staleness == 0 else None,
                "shards": [[s.to_json() for s in shard] for shard in shards],
                "optimizer": describe_optimizer(self.settings.optimizer, self.model),
            }
            self._processes = spawn.start_servers(self.store, self._prefix, spec)
        spawn.wait_until_ready(self.store, self._prefix, self.servers, self._processes, timeout_s)
        group = spawn.join_group(
            self.store, self._prefix, self._rank, self._workers + self.servers, timeout_s
        )
        self.link = ServerLink(
            group,
            self._layouts,
            workers=self._workers,
            timeout_s=timeout_s,
            store=self.store,
            prefix=self._prefix,
        )

    # -- the step ----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._workers

    def train_step(self, inputs: Any, targets: Any) -> StepStats:
        if self._finished:
            raise RuntimeError(
                "this worker called finish() and may not push again; build a new engine to "
                "train further."
            )
        samples = batch_size(inputs)
        workers, k = self._workers, self.gradient_accumulation
        check_divisible(samples, replicas=workers, micro_batches=k)
        bytes_before = self.link.bytes_sent
        self._pull(for_step=True)
        self._send_rates()
        if self._last_compute_s is not None:
            self._straggle(self._last_compute_s)
        started = time.perf_counter()
        share_in = to_device(take_share(inputs, self._rank, workers), self._device)
        share_tgt = to_device(take_share(targets, self._rank, workers), self._device)
        self.model.train()
        self._buffers.clear_grads()
        self.memory.begin_step(self.steps_taken)
        # The servers average the workers' pushes, so a summed loss is divided by the
        # global count over the workers (see ``loss_reduction``).
        totals = LossTotals(
            self.loss_fn, targets, share_tgt, parts=k, averaged_by=workers, device=self._device
        )
        loss_scale = self.precision.loss_factor()  # 1 but under fp16; servers average workers
        # a model's own loss: each part's sum over the global count, times the parts the
        # servers and this worker average (``model_loss_items``), as a summed loss is
        items = with_num_items(self.model, inputs, k * workers, self.loss_fn)
        micro = zip(split_micro(share_in, k), split_micro(share_tgt, k), strict=True)
        for index, (micro_in, micro_tgt) in enumerate(micro):
            micro_in = part_inputs(micro_in, items, k * workers)
            with self.memory.forward(index), self.precision.autocast(self._device):
                loss = totals.add(self.loss_fn(call_model(self.model, micro_in), micro_tgt))
            if totals.summed:
                scaled = loss / totals.divisor
            else:
                scaled = loss if k == 1 else loss / k  # as single divides: fp32 bit for bit
            (scaled if loss_scale == 1.0 else scaled * loss_scale).backward()
            self.memory.release(index)
        share_loss = float(totals.contribution())
        # fp16: this worker's own gradients decide, with no message (``synchronized=True``
        # skips the vote): no ps worker may wait on another, and it pushes only its own.
        grads = (param.grad for _, param in self._params)
        carries = self.precision.unscale_and_check(grads, synchronized=True)
        if carries and self.max_grad_norm is not None and self.staleness != 0:
            # Each asynchronous push is a step of its own: clipped here, by its own norm.
            self._grad_norm = float(clip_local(self.model.parameters(), self.max_grad_norm))
        compute_s = time.perf_counter() - started
        if self._last_compute_s is None:  # the first step: no earlier compute to go by
            self._straggle(compute_s)
        self._last_compute_s = compute_s
        loss = self._push(samples // workers, share_loss, skipped=not carries)
        self.steps_taken += 1
        self.memory.end_step()
        return self._step_stats(loss, samples // workers, self.link.bytes_sent - bytes_before)

    def _straggle(self, compute_s: float) -> None:
        """The straggler knob: its worker sleeps (slowdown - 1) times a step's compute.

        Where the sleep goes matters on devices that share CPUs (the only place this knob
        is used): the benchmarks' dp straggler sleeps after its step, so between getting
        the parameters and computing the next gradient. Here the sleep goes at the same
        place, between the pull and the compute, timed by the previous step's compute
        (the first step, with nothing to go by, sleeps after computing). Sleeping after
        the compute instead would have the straggler compute just when its previous push
        released the fast workers, so its compute, and the sleep scaled from it, would
        stretch with their contention: under a staleness bound that made ps slower than
        dp for no reason of its own. Either way a pull and its push are ``slowdown``
        times a compute apart, so the staleness of its pushes is the same.
        """
        if self.straggler is not None and self.straggler["rank"] == self._rank:
            time.sleep((self.straggler["slowdown"] - 1.0) * compute_s)

    def _pull(self, *, for_step: bool = False) -> None:
        """Bring the servers' current parameters into this worker's model (copied from the
        replies, or written in place by the servers: see ``worker_buffers``), once the
        staleness bound lets this worker start its next step; ``for_step``: the pull of a
        training step, which the servers may extrapolate (see ``lookahead``)."""
        replies = self.link.request(
            Op.PULL,
            clock=self.steps_taken,
            lookahead=for_step and self.lookahead,
            reply_payloads=self._buffers.pull_payloads(),
        )
        for s, (header, _) in enumerate(replies):
            self._versions[s] = int(header[1])
        self._buffers.take_pull()

    def _push(self, samples: int, share_loss: float, *, skipped: bool = False) -> float:
        """Push this step's gradients; ``skipped``: the header alone, carrying none.

        Returns the step's loss: in a plain synchronous round the global batch's, which
        the reply brings once the round closed (with the round's gradient norm before
        clipping, where the servers clip); otherwise ``share_loss``, this share's."""
        has_grad = self._buffers.has_grad()
        replies = self.link.request(
            Op.PUSH,
            payloads=None if skipped else self._buffers.push_payloads(),
            has_grad=[[flag and not skipped for flag in shard] for shard in has_grad],
            skipped=skipped,
            clock=self.steps_taken,
            pulled=list(self._versions),
            samples=samples,
            loss=share_loss,
        )
        self.server_samples = int(replies[0][0][2])
        if self.staleness == 0 and not self.backup_workers:
            norm = float(replies[0][0][GRAD_NORM_FIELD])
            if self.max_grad_norm is not None and norm == norm:  # NaN: no gradient, no step
                self._grad_norm = norm
            return float(replies[0][0][ROUND_LOSS_FIELD])
        return share_loss

    def _attach_shared_regions(self) -> tuple[list, list]:
        """Create this worker's pull and push region per server, have each server map
        them, and delete the files at once (see ``shared_memory``); their flat tensors."""
        pulls: list[SharedRegion] = []
        pushes: list[SharedRegion] = []
        try:
            for s, layout in enumerate(self._layouts):
                pulls.append(SharedRegion.create(layout, f"w{self._rank}-s{s}-pull"))
                pushes.append(SharedRegion.create(layout, f"w{self._rank}-s{s}-push"))
            requests = [
                {"push": str(push.path), "pull": str(pull.path)}
                for push, pull in zip(pushes, pulls, strict=True)
            ]
            self.link.send_json(Op.ATTACH, requests)
        finally:
            for region in (*pulls, *pushes):
                region.unlink()
        return [r.flats for r in pulls], [r.flats for r in pushes]

    # -- reading and writing state ------------------------------------------------------------

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any) -> float:
        """Mean loss over the whole global batch, with the servers' current parameters."""
        self._pull()
        was_training = self.model.training
        self.model.eval()
        with self.precision.autocast(self._device):
            outputs = call_model(self.model, to_device(inputs, self._device))
            result = self.loss_fn(outputs, to_device(targets, self._device))
        self.model.train(was_training)
        return loss_value(result)

    def combine_tally(self, sums: torch.Tensor) -> torch.Tensor:
        """No worker waits on another: each keeps its own sums. Its evaluation covers the
        whole batch (with the parameters it pulled); in training, its own shares, as its
        step's loss is its share's."""
        return sums

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The servers' current parameters (and this worker's buffers), canonical, on CPU.

        Reads wait as a step would (the staleness bound): with ``staleness=0`` they include
        every live worker's pushes up to this worker's last step.
        """
        self._pull()
        return canonical_state(self.model)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``state`` here and overwrite the servers' parameters with it."""
        self.model.load_state_dict(state)
        self._set_parameters()

    def _set_parameters(self) -> None:
        payloads = [
            layout.pack(shard)
            for layout, shard in zip(self._layouts, self._shard_params, strict=True)
        ]
        self.link.request(Op.SET, payloads=payloads)

    def layout(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "world_size": self._workers,
            "servers": self.servers,
            "staleness": self.staleness,
            "backup_workers": self.backup_workers,
            "lookahead": self.lookahead,
            "transport": self.transport,
        }

    def wait_for_bound(self) -> None:
        """Return once this worker could start its next step (and hold what it pulled)."""
        self._pull()

    def claim(self, what: str) -> tuple[bool, str]:
        """Whether this worker is the first to reach its next ``what`` (a save, a load).

        Workers reach the same call at different times under asynchrony, and none may wait
        for another; the first one does the work, keyed on the launch store. Returns the
        decision and the key, under which the claimant can post the outcome.
        """
        self._claims[what] = self._claims.get(what, 0) + 1
        key = f"{self._prefix}/{what}/{self._claims[what]}"
        return self.store.add(f"{key}/claim", 1) == 1, key

    # -- metrics and the end ------------------------------------------------------------------

    def ps_metrics(self) -> dict[str, Any]:
        """What the servers measured: pushes and pushes/s per worker, the staleness histogram
        of applied pushes, pushes that carried no gradient (fp16 overflow) per worker, lost
        workers. Per-worker figures and the histogram are server
        0's (every push reaches every server); ``per_server`` holds each server's own.
        """
        replies = [payload for _, payload in self.link.request(Op.METRICS, json_reply=True)]
        lead = replies[0]
        lost: dict[str, str] = {}
        for reply in replies:
            lost.update(reply["lost_workers"])
        return {
            "servers": self.servers,
            "staleness": self.staleness,
            "staleness_lr": self.staleness_lr,
            "backup_workers": self.backup_workers,
            "lookahead": self.lookahead,
            "transport": self.transport,
            "mean_lr_factor": lead["mean_lr_factor"],
            "workers": self._workers,
            "pushes": {int(w): n for w, n in lead["pushes"].items()},
            "pushes_per_s": {int(w): r for w, r in lead["pushes_per_s"].items()},
            "staleness_histogram": {int(s): n for s, n in lead["staleness_histogram"].items()},
            "skipped_pushes": {int(w): n for w, n in lead["skipped_pushes"].items()},
            "lost_workers": {int(w): why for w, why in sorted(lost.items())},
            "samples_applied": lead["samples_applied"],
            "per_server": replies,
        }

    def _rates(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def _send_rates(self) -> None:
        """The servers' learning rates follow this worker's optimizer (a scheduler's, or
        the user's own change): sent after the pull, so that in a synchronous round every
        worker's rate for the step has arrived before the round's update."""
        rates = self._rates()
        if rates != self._rates_sent:
            self.link.send_json(Op.RATES, [{"lr": rates}] * self.servers)
            self._rates_sent = rates

    def run_metrics(self) -> dict[str, Any]:
        return self.ps_metrics()

    def finish_training(self) -> None:
        """The final checkpoint must hold every live worker's pushes."""
        self.finish(wait=True)

    def finish(self, *, wait: bool = False) -> None:
        """Say that this worker will push no more, so that no other worker waits for it.

        Under a staleness bound, a worker that stops pushing while others go on would
        hold them back; a loop whose workers stop at different steps (a sample budget)
        calls this when it stops. With ``wait``, return once every live worker finished
        too (bounded by ``timeout_s``), so that what is read next (a final checkpoint, a
        final evaluation) holds every push. Reading still works afterwards.
        """
        if not self._finished:
            self._finished = True
            self.link.request(Op.DONE, wait=wait)

    def close(self) -> None:
        """Tell the servers this worker is done; worker 0 then waits for them to exit.

        Optional: a worker process that ends closes its connections, which the servers also
        take as goodbye.
        """
        if self._closed:
            return
        self._closed = True
        self._finished = True
        self.link.goodbye()
        spawn.stop_servers(self._processes)

    @property
    def server_pids(self) -> list[int]:
        """Process ids of the servers (known to worker 0, which started them)."""
        return [process.pid for process in self._processes]
