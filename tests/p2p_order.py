"""The order in which a rank posts its point-to-point calls, and the check NCCL needs of it.

`recording()` notes, on one rank, every send and receive it posts, batch by batch: the calls
of one `dist.batch_isend_irecv` form a batch, any other call is a batch of its own.
`assert_nccl_can_run` plays every rank's batches as NCCL runs them: a rank's batches one
after another on one stream; a batch done once each of its messages is matched; a message
matched once both ranks have reached the batches holding its two ends (a large send waits
for its receive, and NCCL sets up a pair of ranks only when both call it). The k-th send
from q to r pairs with the k-th receive r posts from q, as NCCL pairs them, and they must
have the same bytes. It fails naming the batch each rank waits in.

`run_emulated` runs a script on the emulated box (parakit.emulation: 4 GPUs and the NCCL
that stops where NCCL would hang), where the same order is put to the test by the backend.
"""
from __future__ import annotations

import contextlib
import json
from collections import Counter

import torch.distributed as dist

from conftest import run_script
from parakit import CommLog

P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


@contextlib.contextmanager
def recording():
    """Yields a list that holds, after the block, this rank's batches: [[(kind, global peer,
    bytes), ...], ...], kind "send" or "recv"."""
    spans, batched = [], dist.batch_isend_irecv
    posted: list[list[tuple[str, int, int]]] = []

    def noted(ops):
        start = len(log.records)
        works = batched(ops)
        spans.append((start, len(log.records)))
        return works

    dist.batch_isend_irecv = noted
    try:
        with CommLog() as log:
            yield posted
    finally:
        dist.batch_isend_irecv = batched
    starts = dict(spans)
    i = 0
    while i < len(log.records):
        end = starts.get(i, i + 1)
        calls = [(P2P[r.op], r.peer, r.nbytes) for r in log.records[i:end] if r.op in P2P]
        posted += [calls] if calls else []
        i = end


def assert_nccl_can_run(posted: list[list[list[tuple[str, int, int]]]]) -> None:
    """posted[r]: rank r's batches as `recording` gives them."""
    ends, mine = {}, {}  # (is the send, src, dst, k) -> (rank, batch, bytes); (rank, batch) -> its ends
    for r, batches in enumerate(posted):
        count = Counter()
        for j, batch in enumerate(batches):
            for kind, peer, nbytes in batch:
                key = (True, r, peer) if kind == "send" else (False, peer, r)
                ends[key + (count[key],)] = (r, j, nbytes)
                mine.setdefault((r, j), []).append(key + (count[key],))
                count[key] += 1
    for (send, src, dst, k), (r, j, nbytes) in ends.items():
        other = ends.get((not send, src, dst, k))
        assert other is not None, f"message {k} from rank {src} to rank {dst} has no {'receive' if send else 'send'}"
        assert other[2] == nbytes, f"message {k} from rank {src} to rank {dst}: {nbytes} B against {other[2]} B"
    reached, moved = [0] * len(posted), True
    while moved:
        moved = False
        for r, batches in enumerate(posted):
            while reached[r] < len(batches) and all(
                    reached[q] >= j for send, *rest in mine[(r, reached[r])] for q, j, _ in [ends[(not send, *rest)]]):
                reached[r], moved = reached[r] + 1, True
    stuck = [f"rank {r} waits in batch {reached[r]}: {posted[r][reached[r]]}" for r in range(len(posted))
             if reached[r] < len(posted[r])]
    assert not stuck, "NCCL would deadlock: " + "; ".join(stuck)


def run_emulated(tmp_path, body: str) -> dict:
    """Run `body` (which prints one JSON line last) in a fresh interpreter on an emulated box
    with 4 GPUs; returns that line."""
    done = run_script(tmp_path, "import os\nos.environ['PARAKIT_EMULATE_GPUS'] = '4'\n" + body, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.splitlines()[-1])
