"""A worker's side of the conversation with the parameter servers.

Every request goes to all servers at once (each holds a shard), then the worker waits for
each reply. Every wait is bounded by the job's timeout, and a failed wait becomes one
clear error: a server that stopped (its connection closed) ends the run, since the
parameters it held exist nowhere else; a server that does not answer in time says which
one and what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paratrain.parallel.ps import jobkeys
from paratrain.parallel.ps.protocol import (
    REPLY_DATA_TAG,
    REPLY_FIELDS,
    REPLY_TAG,
    REQUEST_DATA_TAG,
    REQUEST_TAG,
    Op,
    ShardLayout,
    Status,
    decode_json,
    encode_json,
    post_recv,
    reply_error,
    request_header,
    wait_all,
)


class ParameterServerLost(RuntimeError):
    """A parameter server stopped or stopped answering; the run cannot go on without it."""


class ServerLink:
    """Requests from one worker to every server of its job, with bounded waits."""

    def __init__(
        self,
        group,
        layouts: Sequence[ShardLayout],
        *,
        workers: int,
        timeout_s: float,
        store: dist.Store,
        prefix: str,
    ) -> None:
        self.group, self.layouts = group, list(layouts)
        self.workers = workers
        self.timeout = timedelta(seconds=timeout_s)
        self.store, self.prefix = store, prefix
        self.bytes_sent = 0

    def server_rank(self, server: int) -> int:
        return self.workers + server

    def request(
        self,
        op: Op,
        *,
        payloads: Sequence[Sequence[torch.Tensor]] | None = None,
        reply_payloads: Sequence[Sequence[torch.Tensor]] | None = None,
        json_reply: bool = False,
        **fields: Any,
    ) -> list[tuple[torch.Tensor, Any]]:
        """Send ``op`` to every server; returns each server's (reply header, payload).

        A field given as a list holds one value per server. ``payloads[s]`` goes to server
        ``s`` after the header; ``reply_payloads[s]`` are
        receive buffers for what server ``s`` sends back after its header; a JSON reply is
        decoded (and a server's error raised as ``RuntimeError``).
        """
        servers = range(len(self.layouts))
        has_grad = fields.pop("has_grad", None)
        sends = []
        for s in servers:
            mine = {k: v[s] if isinstance(v, (list, tuple)) else v for k, v in fields.items()}
            header = request_header(
                op,
                flags=len(self.layouts[s].specs),
                has_grad=has_grad[s] if has_grad else (),
                **mine,
            )
            sends.append((s, header, REQUEST_TAG))
            for tensor in payloads[s] if payloads else ():
                sends.append((s, tensor, REQUEST_DATA_TAG))
        replies = [torch.empty(REPLY_FIELDS, dtype=torch.float64) for _ in servers]
        reply_works = [
            post_recv(self.group, [replies[s]], self.server_rank(s), REPLY_TAG) for s in servers
        ]
        data_works = []
        if reply_payloads:
            data_works = [
                post_recv(self.group, reply_payloads[s], self.server_rank(s), REPLY_DATA_TAG)
                for s in servers
            ]
        send_works = []
        for s, tensor, tag in sends:
            send_works.append((s, self.group.send([tensor], self.server_rank(s), tag)))
            self.bytes_sent += tensor.numel() * tensor.element_size()
        for s, work in send_works:
            self._wait(s, [work])
        results: list[tuple[torch.Tensor, Any]] = []
        for s in servers:
            self._wait(s, reply_works[s])
            if data_works:
                self._wait(s, data_works[s])
            payload: Any = reply_payloads[s] if reply_payloads else None
            if json_reply:
                data = torch.empty(int(replies[s][3]), dtype=torch.uint8)
                self._wait(s, post_recv(self.group, [data], self.server_rank(s), REPLY_DATA_TAG))
                payload = decode_json(data)
                if int(replies[s][0]) == Status.ERROR:
                    raise RuntimeError(payload["error"])
            results.append((replies[s], payload))
        return results

    def send_json(self, op: Op, values: Sequence[Any]) -> list[Any]:
        """A request carrying one JSON value per server; returns the decoded replies."""
        data = [encode_json(v) for v in values]
        results = []
        # One server at a time: each request announces its own JSON length in its header.
        for s, tensor in enumerate(data):
            results.append(self._single_json(s, op, tensor))
        return results

    def _single_json(self, s: int, op: Op, data: torch.Tensor) -> Any:
        header = request_header(op, flags=len(self.layouts[s].specs), json_bytes=data.numel())
        rank = self.server_rank(s)
        reply = torch.empty(REPLY_FIELDS, dtype=torch.float64)
        reply_work = post_recv(self.group, [reply], rank, REPLY_TAG)
        works = [self.group.send([header], rank, REQUEST_TAG)]
        works.append(self.group.send([data], rank, REQUEST_DATA_TAG))
        self._wait(s, works)
        self._wait(s, reply_work)
        body = torch.empty(int(reply[3]), dtype=torch.uint8)
        self._wait(s, post_recv(self.group, [body], rank, REPLY_DATA_TAG))
        value = decode_json(body)
        if int(reply[0]) == Status.ERROR:
            raise reply_error(value)
        return value

    def goodbye(self) -> None:
        """Tell every server this worker is done (no reply: the server may exit at once)."""
        for s, layout in enumerate(self.layouts):
            header = request_header(Op.BYE, flags=len(layout.specs))
            self._wait(s, [self.group.send([header], self.server_rank(s), REQUEST_TAG)])

    def _wait(self, server: int, works) -> None:
        try:
            wait_all(works, self.timeout)
        except RuntimeError as error:
            raise self._explain(server, error) from None

    def _explain(self, server: int, error: RuntimeError) -> ParameterServerLost:
        said = jobkeys.server_error(self.store, self.prefix, server)
        text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        if said:
            return ParameterServerLost(
                f"parameter server {server} stopped, so this ps run cannot go on (the "
                f"parameters it held exist nowhere else). It said:\n{said}"
            )
        if "timed out" in text.lower() or "timeout" in text.lower():
            return ParameterServerLost(
                f"parameter server {server} did not answer within {self.timeout.total_seconds():g}"
                " s; if workers legitimately wait longer (a slow straggler under a staleness "
                f"bound), raise the timeout. Backend said: {text}"
            )
        return ParameterServerLost(
            f"parameter server {server} is gone (its connection closed), so this ps run cannot "
            f"go on: the parameters it held exist nowhere else. Backend said: {text}"
        )
