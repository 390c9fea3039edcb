"""A parameter-server process: holds one shard of the parameters and its optimizer state.

Started by the job's worker 0 as ``python -m paratrain.parallel.ps.server``
(a fresh interpreter: launch's workers are ordinary processes, but a fresh process
inherits nothing of the worker's threads or communication state). It reads the job's
description from the launch store, builds its parameters and the user's optimizer over
them, and joins a gloo group with the workers.

Why one thread per worker: gloo has no "receive from whoever is ready" that survives a
dead peer, and a receive cannot be polled without a timeout, and a timeout closes the
connection. A thread blocked on one worker's next request costs nothing, wakes as soon
as that worker sends, and fails at once (connection closed) when that worker dies, which
is exactly when the worker must be retired. Updates happen under one lock, so pushes are
applied one at a time, in arrival order.

The server's receives have no deadline of their own (a worker may legitimately be busy
evaluating for a long time); the server's life is bounded instead: it exits once every
worker said goodbye or died, and within a second of the launch store disappearing (the
launch ended or its process died).

A worker on the shared-memory transport (the default on a host with ``/dev/shm``) has
this server map its push and pull regions once (``Op.ATTACH``); its pushes are then read
from, and its pulls written into, those regions, and only headers cross gloo (see
``shared_memory``).

Asynchronous pushes (``staleness`` >= 1 or None) are applied at a learning rate divided
by their staleness + 1 unless the job asks for ``staleness_lr="constant"``; see ``stale_lr``.
With ``backup_workers`` (synchronous only), a version closes on its first N - b fresh
pushes and late pushes are folded into the open version at the same factor; see
``backup``.

A push that carries no gradient (the worker's fp16 gradients overflowed, so it has none
worth sending) moves that worker's clock and changes nothing else. Under ``staleness=0``
a version's mean gradient is taken over the pushes that carried one, not over every
push: a skipped push means "this share's gradient is unknown", not "it is zero", and
counting it as zero would shrink that version's step by a factor that depends on which
worker overflowed (a hidden learning-rate cut, and a bias in Adam's moments). The mean
over the other shares is the same estimate of the batch gradient from fewer samples.
A version in which every push was skipped takes no optimizer step but still completes,
so the round after it starts cleanly; samples of skipped pushes are not counted as
applied.

The loss of a plain synchronous round (``staleness=0``, no backup workers): each push's
header carries the loss of the worker's share, the server adds them up, weighted by
samples (skipped pushes too: their forward was fine), and answers each push of the round
only once the round has closed, with the global batch's mean loss in the reply. That
moves each worker's wait for the round from its next pull (which then finds the round
closed and returns at once) to the end of its push: no worker waits longer than the
round already made it. With backup workers the reply does not wait: a version's
gradient is then not one global batch's (late shares fold into the next version), and
waiting for the slow shares is what backup workers are there to avoid.

Clipping a plain synchronous round (``max_grad_norm``): once its mean gradient is formed,
the server sends the square norm of its shard to every other server, receives theirs, and
scales its shard by torch's coefficient of the total before stepping; the reply to the
round's pushes carries the norm before clipping. See ``clipping``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoints.format import Checkpoint, CheckpointError, write_shard
from paratrain.checkpoints.wrapper_names import renaming_for
from paratrain.parallel.optim_state import load_named_optimizer_state, named_optimizer_state
from paratrain.parallel.ps import jobkeys
from paratrain.parallel.ps.backup import quorum
from paratrain.parallel.ps.clipping import RoundClipper
from paratrain.parallel.ps.lookahead import PullLookahead
from paratrain.parallel.ps.optimizer_spec import build_optimizer
from paratrain.parallel.ps.protocol import (
    LOOKAHEAD_FIELD,
    LOSS_FIELD,
    REPLY_DATA_TAG,
    REPLY_TAG,
    REQUEST_DATA_TAG,
    REQUEST_FIELDS,
    REQUEST_TAG,
    SKIPPED_FIELD,
    Op,
    ShardLayout,
    Status,
    decode_json,
    encode_json,
    error_value,
    post_recv,
    reply_header,
    send_all,
    wait_all,
)
from paratrain.parallel.ps.sharding import ParamSpec
from paratrain.parallel.ps.shared_memory import SharedRegion
from paratrain.parallel.ps.stale_lr import lr_factor, scaled_learning_rate
from paratrain.parallel.ps.staleness import StalenessBook

_NO_DEADLINE = timedelta(days=30)  # see the module docstring: the job bounds the server
_POLL_S = 0.5


class ShardServer:
    """The state of one server and the handling of each request."""

    def __init__(self, spec: dict, index: int, store: dist.Store, prefix: str) -> None:
        self.index, self.store, self.prefix = index, store, prefix
        self.workers, self.servers = spec["workers"], spec["servers"]
        self.layout = ShardLayout([ParamSpec.from_json(p) for p in spec["shards"][index]])
        # Every parameter is a view of one flat tensor per dtype, so a pull copies the shard
        # with one copy per dtype rather than one per parameter (under the lock, which the
        # other workers' requests wait on).
        self._flats = [flat.zero_() for flat in self.layout.empty()]
        views = self.layout.views(self._flats)
        self.params = {
            s.name: nn.Parameter(view) for s, view in zip(self.layout.specs, views, strict=True)
        }
        self.ordered = [self.params[s.name] for s in self.layout.specs]
        self.optimizer = build_optimizer(spec["optimizer"], self.params)
        # Which of the worker's parameter groups each of this shard's groups is (a shard
        # may hold no parameter of some group): learning rates arrive in the worker's order.
        described = {
            name: index
            for index, group in enumerate(spec["optimizer"]["groups"])
            for name in group["params"]
        }
        names = {id(p): name for name, p in self.params.items()}
        self._group_of = [described[names[id(g["params"][0])]] for g in self.optimizer.param_groups]
        self.book = StalenessBook(self.workers, spec["staleness"])
        self.synchronous = spec["staleness"] == 0
        self.staleness_lr = spec["staleness_lr"]
        self.backup = spec.get("backup_workers", 0)
        # A plain synchronous round answers its pushes with its global-batch loss.
        self.reports_round_loss = self.synchronous and not self.backup
        self._pending_loss = 0.0  # this round's losses x samples, skipped pushes too
        self._pending_loss_samples = 0
        # version -> its round's mean loss and (where clipped) gradient norm before clipping
        self._round_losses: dict[int, tuple[float, float]] = {}
        # Synchronous clipping by the global norm (see ``clipping``); the workers clip
        # asynchronous pushes themselves, so their spec names no bound.
        self.max_grad_norm = spec.get("max_grad_norm") if self.synchronous else None
        self.clipper: RoundClipper | None = None  # made once the group exists (``run``)
        self._awaiting: dict[int, int] = {}  # worker -> the version its push waits for
        # Extrapolated step pulls (asynchronous and bounded runs; see ``lookahead``).
        wants_lookahead = spec.get("lookahead", False) and not self.synchronous
        self.lookahead = PullLookahead(self._flats) if wants_lookahead else None
        self._pushed_fresh_on: dict[int, int] = {}  # worker -> version of its last fresh push
        self.lock = threading.Condition()
        self.version = 0
        self.samples_applied = 0
        self.initialized = False
        self.seeded = False  # worker 0's initial SET arrived; see _load
        self.group = None
        self._pending: list[torch.Tensor] | None = None
        self._packed: tuple[int, list[torch.Tensor]] | None = None  # (version, flat params)
        self._pending_has_grad = [False] * len(self.ordered)
        self._pending_count = 0  # pushes of this round, skipped ones too
        self._pending_weight = 0.0  # of the pushes of this round that carried a gradient
        self._pending_fresh = 0  # pushes of this round computed on the open version
        self._pending_samples = 0
        # worker -> (push region, pull region), for workers on the shared-memory transport
        self._shared: dict[int, tuple[SharedRegion, SharedRegion]] = {}
        # worker -> where its pushes land over gloo, reused: each push is used up (applied,
        # or added into the round's sum) under the lock before its thread receives the next
        self._gloo_grads: dict[int, list[torch.Tensor]] = {}

    # -- serving ----------------------------------------------------------------------------

    def run(self, group) -> None:
        """Serve every worker until all are done or gone, or the launch store disappears."""
        self.group = group
        if self.max_grad_norm is not None:
            ranks = [self.workers + s for s in range(self.servers)]
            self.clipper = RoundClipper(group, ranks[self.index], ranks, self.max_grad_norm)
        threads = [
            threading.Thread(target=self._serve, args=(w,), name=f"ps-worker-{w}", daemon=True)
            for w in range(self.workers)
        ]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            time.sleep(_POLL_S)
            try:
                self.store.check([jobkeys.spec_key(self.prefix)])
            except Exception:  # the launch is over: nobody is left to serve
                os._exit(0)

    def _serve(self, worker: int) -> None:
        header = torch.empty(REQUEST_FIELDS + len(self.ordered), dtype=torch.float64)
        while True:
            try:
                wait_all(post_recv(self.group, [header], worker, REQUEST_TAG), None)
                op = Op(int(header[0]))
                if op is Op.BYE:
                    self._retire(worker, lost=None)
                    return
                payload = self._receive_payload(worker, op, header)
            except RuntimeError as error:  # the connection closed: the worker died
                self._retire(worker, lost=_first_line(error))
                return
            try:
                reply = self._process(worker, op, header, payload)
                if op is Op.PUSH and worker in self._awaiting:
                    reply = self._round_reply(worker)
            except (CheckpointError, OSError, KeyError, ValueError) as error:
                if op not in (Op.SAVE, Op.LOAD, Op.ATTACH, Op.RATES):
                    self._fatal(traceback.format_exc())
                data = encode_json(error_value(self.index, error))
                reply = [reply_header(Status.ERROR, json_bytes=data.numel()), data]
            except Exception:  # a bug: say so where the workers will look, and stop
                self._fatal(traceback.format_exc())
            try:
                send_all(self.group, reply[:1], worker, REPLY_TAG, None)
                send_all(self.group, reply[1:], worker, REPLY_DATA_TAG, None)
            except RuntimeError as error:
                self._retire(worker, lost=_first_line(error))
                return

    def _receive_payload(self, worker: int, op: Op, header: torch.Tensor) -> list[torch.Tensor]:
        if op is Op.PUSH and not _skipped(header):
            if worker in self._shared:  # already in place: nothing follows the header
                return self._shared[worker][0].flats
            buffers = self._gloo_grads.get(worker)
            if buffers is None:  # made at a gloo worker's first push, none for the others
                buffers = self._gloo_grads[worker] = self.layout.empty()
        elif op is Op.SET:
            buffers = self.layout.empty()
        elif op in (Op.SAVE, Op.LOAD, Op.ATTACH, Op.RATES):
            buffers = [torch.empty(int(header[5]), dtype=torch.uint8)]
        else:
            return []
        wait_all(post_recv(self.group, buffers, worker, REQUEST_DATA_TAG), None)
        return buffers

    def _process(self, worker: int, op: Op, header: torch.Tensor, payload) -> list[torch.Tensor]:
        with self.lock:
            self.book.seen(worker)
            if op is Op.PULL:
                return self._pull(worker, for_step=bool(header[LOOKAHEAD_FIELD] == 1.0))
            if op is Op.PUSH:
                flags = [bool(v) for v in header[REQUEST_FIELDS:].tolist()]
                grads = None if _skipped(header) else payload
                joins = self.version + 1  # the version this push's round will make
                loss = float(header[LOSS_FIELD])
                self._push(worker, grads, flags, int(header[2]), int(header[3]), loss=loss)
                if self.reports_round_loss:
                    self._awaiting[worker] = joins  # _serve answers once the round closed
                return [reply_header(version=self.version, samples=self.samples_applied)]
            if op is Op.DONE:
                self.book.retire(worker)
                if self.synchronous:
                    self._apply_if_complete()
                self.lock.notify_all()
                while int(header[6]) == 1 and self.book.live:  # wait for every live worker
                    self.lock.wait(timeout=_POLL_S)
                return [reply_header(version=self.version, samples=self.samples_applied)]
            if op is Op.SET:
                with torch.no_grad():
                    for flat, value in zip(self._flats, payload, strict=True):
                        flat.copy_(value)
                self.initialized = self.seeded = True
                self._packed = None
                if self.lookahead is not None:
                    self.lookahead.forget_step()
                self.lock.notify_all()
                return [reply_header(version=self.version)]
            if op is Op.SAVE:
                return self._json_reply(self._save(decode_json(payload[0])))
            if op is Op.LOAD:
                return self._json_reply(self._load(decode_json(payload[0])))
            if op is Op.METRICS:
                return self._json_reply(self._metrics())
            if op is Op.ATTACH:
                return self._json_reply(self._attach(worker, decode_json(payload[0])))
            if op is Op.RATES:
                rates = decode_json(payload[0])["lr"]
                for group, index in zip(self.optimizer.param_groups, self._group_of, strict=True):
                    group["lr"] = rates[index]
                return self._json_reply({"set": True})
        raise ValueError(f"unknown request {op!r}")

    def _round_reply(self, worker: int) -> list[torch.Tensor]:
        """The reply to ``worker``'s push in a plain synchronous round: sent once the
        round closed, with its global-batch loss (see the module docstring)."""
        with self.lock:
            version = self._awaiting.pop(worker)
            while self.version < version:
                self.lock.wait(timeout=_POLL_S)
            loss, norm = self._round_losses.get(version, (float("nan"), float("nan")))
            header = reply_header(
                version=self.version, samples=self.samples_applied, loss=loss, grad_norm=norm
            )
            return [header]

    def _json_reply(self, value) -> list[torch.Tensor]:
        data = encode_json(value)
        return [reply_header(version=self.version, json_bytes=data.numel()), data]

    # -- the operations (called with the lock held) ----------------------------------------

    def _pull(self, worker: int, *, for_step: bool = False) -> list[torch.Tensor]:
        """Current parameters, once the staleness bound lets ``worker`` start a step; for
        a step of an asynchronous run, where they will be when its push lands (see
        ``lookahead``)."""
        while not (self.initialized and self._may_pull(worker)):
            self.lock.wait(timeout=_POLL_S)
        header = reply_header(version=self.version, samples=self.samples_applied)
        lookahead = self.lookahead if for_step else None
        if worker in self._shared:
            # Written under the lock, read by the worker after this reply, and written
            # again only at its next pull: nothing else touches the region meanwhile.
            region = self._shared[worker][1].flats
            if lookahead is not None:
                lookahead.write(worker, region)
            else:
                for target, flat in zip(region, self._flats, strict=True):
                    target.copy_(flat)
            return [header]
        extrapolated = lookahead.extrapolated(worker) if lookahead is not None else None
        if extrapolated is not None:
            return [header, *extrapolated]
        if self._packed is None or self._packed[0] != self.version:
            # One copy per version, shared by every pull of it (sends only read it); a new
            # version gets a new tensor, as an earlier one may still be on its way out.
            self._packed = (self.version, [flat.clone() for flat in self._flats])
        return [header, *self._packed[1]]

    def _attach(self, worker: int, request: dict) -> dict:
        """Map ``worker``'s push and pull regions: from now on its pushes and pulls carry
        only headers over gloo (see ``shared_memory``)."""
        regions = (
            SharedRegion.attach(request["push"], self.layout),
            SharedRegion.attach(request["pull"], self.layout),
        )
        self._shared[worker] = regions
        return {"attached": True}

    def _may_pull(self, worker: int) -> bool:
        """The staleness bound; with backup workers, the version this worker last pushed
        fresh on must have closed (see ``backup``)."""
        if self.backup:
            return self.version > self._pushed_fresh_on.get(worker, -1)
        return self.book.may_pull(worker)

    def _push(
        self,
        worker: int,
        grads,
        has_grad: Sequence[bool],
        pulled: int,
        samples: int,
        *,
        loss: float = 0.0,
    ) -> None:
        """Apply (or, synchronously, add up) one push; ``grads`` None: it carried none;
        ``loss``: the mean loss of the worker's share."""
        staleness = self.version - pulled
        self.book.record_push(worker, staleness, skipped=grads is None)
        if not self.synchronous:
            if self.lookahead is not None:
                self.lookahead.note_push(worker, staleness)
            if grads is not None:
                factor = lr_factor(self.staleness_lr, staleness)
                with scaled_learning_rate(self.optimizer, factor):
                    self._apply(self.layout.views(grads), has_grad, samples)
            return
        self._pending_count += 1
        self._pending_loss += loss * samples
        self._pending_loss_samples += samples
        # Plain rounds weigh every push alike; with backup workers a late push (the only
        # kind that can be stale) weighs its staleness-aware factor, a fresh one 1.
        factor = lr_factor(self.staleness_lr, staleness) if self.backup else 1.0
        if self.backup and staleness <= 0:
            self._pending_fresh += 1
            self._pushed_fresh_on[worker] = pulled
        if grads is not None:
            if self._pending is None:
                self._pending = [g * factor if factor != 1.0 else g.clone() for g in grads]
            else:
                for total, grad in zip(self._pending, grads, strict=True):
                    total.add_(grad, alpha=factor)
            self._pending_has_grad = [
                a or b for a, b in zip(self._pending_has_grad, has_grad, strict=True)
            ]
            self._pending_weight += factor
            self._pending_samples += samples
        self._apply_if_complete()

    def _round_complete(self) -> bool:
        """Every live worker pushed; with backup workers, a quorum of fresh pushes."""
        if self.backup:
            live = len(self.book.live)
            return not live or self._pending_fresh >= quorum(live, self.backup)
        return self.book.everyone_pushed(self.version + 1)

    def _apply_if_complete(self) -> None:
        """Synchronous mode: once the round is complete, one step with the (weighted) mean
        of the gradients carried (none, and so no step, when every push was skipped)."""
        if self._pending_count == 0 or not self._round_complete():
            return
        seen = self._pending_loss_samples
        round_loss = self._pending_loss / seen if seen else float("nan")
        if self._pending is not None:
            for total in self._pending:
                total.div_(self._pending_weight)
        # Every server clips every round, even one that carried it no gradient, so that
        # each server's n-th exchange pairs with the others' n-th (see ``clipping``).
        norm = self.clipper.clip(self._pending) if self.clipper is not None else float("nan")
        if self._pending is None:
            self._advance(0)
        else:
            grads = self.layout.views(self._pending)
            self._apply(grads, self._pending_has_grad, self._pending_samples)
        self._pending, self._pending_count, self._pending_samples = None, 0, 0
        self._pending_weight, self._pending_fresh = 0.0, 0
        self._pending_has_grad = [False] * len(self.ordered)
        self._pending_loss, self._pending_loss_samples = 0.0, 0
        # A push waits for the round it joined, and the next round cannot close before
        # every live worker pushes again: older rounds' losses are awaited by nobody.
        self._round_losses[self.version] = (round_loss, norm)
        for version in [v for v in self._round_losses if v < self.version - 1]:
            del self._round_losses[version]

    def _apply(self, grads, has_grad: Sequence[bool], samples: int) -> None:
        for param, grad, flag in zip(self.ordered, grads, has_grad, strict=True):
            param.grad = grad if flag else None
        if self.lookahead is not None:
            self.lookahead.before_step()
        self.optimizer.step()
        for param in self.ordered:
            param.grad = None
        self._advance(samples)

    def _advance(self, samples: int) -> None:
        """One version more; ``samples`` more whose gradients were applied."""
        self.version += 1
        self.samples_applied += samples
        self.lock.notify_all()

    def _retire(self, worker: int, *, lost: str | None) -> None:
        with self.lock:
            self.book.retire(worker, lost=lost)
            self._shared.pop(worker, None)  # its regions are unmapped once dropped
            if self.synchronous:
                self._apply_if_complete()
            self.lock.notify_all()

    def _save(self, request: dict) -> dict:
        """Write this shard's parameters and optimizer state into the staging folder."""
        from pathlib import Path

        staging, rank = Path(request["staging"]), self.index
        names = {id(p): name for name, p in self.params.items()}
        files = {f"model-{rank}.safetensors": write_shard(staging, "model", rank, self.params)}
        tensors, groups = named_optimizer_state(self.optimizer, names)
        files[f"optim-{rank}.safetensors"] = write_shard(staging, "optim", rank, tensors)
        return {"files": files, "groups": groups}

    def _load(self, request: dict) -> dict:
        """Take this shard's parameters and optimizer state, by name, from a checkpoint."""
        # Worker 0 seeds every server with its initial parameters while it builds its
        # engine, and whichever worker loads first may be another one: a load that
        # overtook that SET would be overwritten by it, so it waits for it.
        while not self.seeded:
            self.lock.wait(timeout=_POLL_S)
        checkpoint = Checkpoint(request["path"])
        checkpoint.present_names(renaming_for(self.params))  # compiled or not, one model
        saved = set(checkpoint.names("model"))
        missing = sorted(set(self.params) - saved)
        if missing:
            raise CheckpointError(
                f"{checkpoint.directory} has no {missing[0]!r} ({len(missing)} parameter(s) "
                "missing): it was saved from a different model."
            )
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(checkpoint.tensor("model", name))
        self._packed = None
        if self.lookahead is not None:
            self.lookahead.forget_step()
        meta = checkpoint.manifest.get("optimizer")
        if meta:
            state_keys: dict[str, list[str]] = {}
            for key in checkpoint.names("optim"):
                name, _, state_key = key.rpartition("/")
                state_keys.setdefault(name, []).append(state_key)
            load_named_optimizer_state(
                self.optimizer,
                {id(p): name for name, p in self.params.items()},
                meta["param_groups"],
                state_keys,
                lambda key: checkpoint.tensor("optim", key),
            )
        self.initialized = True
        self.lock.notify_all()
        return {"loaded": len(self.params)}

    def _metrics(self) -> dict:
        applied = self.book.histogram  # staleness of every push that carried a gradient
        factors = sum(n * lr_factor(self.staleness_lr, s) for s, n in applied.items())
        return {
            "server": self.index,
            "version": self.version,
            "samples_applied": self.samples_applied,
            "parameter_bytes": self.layout.nbytes,
            "staleness_lr": self.staleness_lr,
            "backup_workers": self.backup,
            "lookahead": self.lookahead is not None,
            # Synchronous pushes are fresh (factor 1) but for backup workers' late ones,
            # which are weighted by the same factor, so the mean is right in every mode.
            "mean_lr_factor": factors / sum(applied.values()) if applied else 1.0,
            **self.book.summary(),
        }

    def _fatal(self, details: str) -> None:
        """Leave the reason on the store for the workers, then stop this process."""
        message = f"parameter server {self.index} failed:\n{details}"
        print(message, file=sys.stderr, flush=True)
        try:
            self.store.set(jobkeys.error_key(self.prefix, self.index), message)
        finally:
            os._exit(1)


def _skipped(header: torch.Tensor) -> bool:
    """Whether a request header says its push carries no gradient."""
    return bool(header[SKIPPED_FIELD] == 1.0)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def _outlive_signals_to_the_job() -> None:
    """Ignore SIGTERM and Ctrl-C's SIGINT: they are the workers' and the launcher's to act on.

    Why: a scheduler preempts a job by sending SIGTERM to every process of it (Slurm,
    Kubernetes), servers included. The workers answer it by finishing their step and
    saving a checkpoint, and in ps the servers write its parameters and optimizer state:
    a server that died of the signal would leave them nothing to save. On Ctrl-C the
    launcher stops the workers, and a server's KeyboardInterrupt would only add a
    traceback. Neither signal can leave a server behind, since its life is bounded by the
    job (see the module docstring): it exits once every worker said goodbye or died, or
    within a second of the launch store disappearing. SIGKILL still ends it at once.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one paratrain parameter server")
    parser.add_argument("--store", required=True, help="host:port of the launch store")
    parser.add_argument("--prefix", required=True, help="this engine's key prefix")
    parser.add_argument("--index", type=int, required=True, help="this server's index")
    args = parser.parse_args(argv)
    _outlive_signals_to_the_job()
    torch.set_num_threads(1)
    import json

    store = jobkeys.connect(args.store)
    store.wait([jobkeys.spec_key(args.prefix)], timedelta(seconds=60))
    spec = json.loads(store.get(jobkeys.spec_key(args.prefix)))
    try:
        server = ShardServer(spec, args.index, store, args.prefix)
    except Exception:
        store.set(jobkeys.error_key(args.prefix, args.index), traceback.format_exc())
        return 1
    store.set(jobkeys.ready_key(args.prefix, args.index), str(os.getpid()))
    size = spec["workers"] + spec["servers"]
    group = dist.ProcessGroupGloo(
        dist.PrefixStore(jobkeys.group_prefix(args.prefix), store),
        spec["workers"] + args.index,
        size,
        _NO_DEADLINE,
    )
    server.run(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
