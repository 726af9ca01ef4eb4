"""parakit.comm on real ranks (gloo on CPU): CommLog counts every call and its bytes
exactly, and ring_all_reduce equals dist.all_reduce while sending 2(N-1)/N of the tensor."""
from __future__ import annotations

import random
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import parakit
from p2p_order import assert_nccl_can_run, recording, run_emulated
from parakit import CollectiveHang, CommLog, ring_all_reduce
from parakit import comm
from parakit.comm import ring_bytes


def records(log):
    """(op, nbytes, group_size, rank, peer, root, wire_bytes) for each record, in call order."""
    return [(r.op, r.nbytes, r.group_size, r.rank, r.peer, r.root, r.wire_bytes) for r in log.records]


# ---------------------------------------------------------------- CommLog

def three_all_reduces():
    with CommLog() as log:
        for _ in range(3):
            dist.all_reduce(torch.ones(10))  # float32: 40 bytes each
    return log.count("all_reduce"), log.nbytes("all_reduce"), log.count(), log.wire_bytes(), log.summary()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_comm_log_counts_three_all_reduces_of_ten_floats(world_size):
    wire = 3 * 2 * (world_size - 1) * 40 // world_size  # 2(N-1)/N of 40 bytes, three times
    for count, nbytes, total, wire_bytes, summary in parakit.launch(three_all_reduces, world_size=world_size):
        assert (count, nbytes, total, wire_bytes) == (3, 120, 3, wire)
        assert list(summary) == ["all_reduce"]
        assert {k: summary["all_reduce"][k] for k in ("count", "nbytes", "wire_bytes")} == {
            "count": 3, "nbytes": 120, "wire_bytes": wire}


def every_op():
    rank, n = dist.get_rank(), dist.get_world_size()
    with CommLog() as log:
        dist.all_gather_single(torch.empty(n * 5), torch.ones(5))  # own input: 20 B
        dist.reduce_scatter_single(torch.empty(5), torch.ones(n * 5))  # full input: n*20 B
        dist.broadcast(torch.ones(6, dtype=torch.float64), src=1)  # 48 B
        if rank % 2 == 0:
            dist.send(torch.ones(7, dtype=torch.int64), rank + 1)  # 56 B
        else:
            dist.recv(torch.empty(7, dtype=torch.int64), rank - 1)
        dist.barrier()
        dist.all_gather([torch.empty(3) for _ in range(n)], torch.ones(3))  # own input: 12 B
    return records(log), log.nbytes(), log.wire_bytes()


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_op_is_recorded_with_its_documented_bytes(world_size):
    n = world_size
    for rank, (got, nbytes, wire_bytes) in enumerate(parakit.launch(every_op, world_size=n)):
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        expected = [
            ("all_gather_single", 20, n, rank, None, None, (n - 1) * 20),
            ("reduce_scatter_single", n * 20, n, rank, None, None, (n - 1) * 20),
            ("broadcast", 48, n, rank, None, 1, 0 if rank == 0 else 48),  # the chain from 1 ends at 0
            ("send", 56, n, rank, peer, None, 56) if rank % 2 == 0 else ("recv", 56, n, rank, peer, None, 0),
            ("barrier", 0, n, rank, None, None, 0),
            ("all_gather", 12, n, rank, None, None, (n - 1) * 12),
        ]
        assert got == expected, f"rank {rank}"
        assert nbytes == sum(e[1] for e in expected)
        assert wire_bytes == sum(e[6] for e in expected)


def nested_calls():
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # both are deprecated in favour of *_single
        for call in (lambda: dist.all_gather_into_tensor(torch.empty(2 * dist.get_world_size()), torch.ones(2)),
                     lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * dist.get_world_size()))):
            with CommLog() as log:
                before = comm.TRACKER.seq
                call()
            out.append((records(log), comm.TRACKER.seq - before, comm.TRACKER.last[0]))
    return out


def test_call_made_inside_another_is_recorded_once_as_the_outer_call():
    n = 2
    for rank, (gather, scatter) in enumerate(parakit.launch(nested_calls, world_size=n)):
        # all_gather_into_tensor calls all_gather_single (and reduce_scatter_tensor
        # reduce_scatter_single) inside: one record, one step of the tracker, the outer name
        assert gather == ([("all_gather_into_tensor", 8, n, rank, None, None, 8)], 1, "all_gather_into_tensor")
        assert scatter == ([("reduce_scatter_tensor", 16, n, rank, None, None, 8)], 1, "reduce_scatter_tensor")


def two_logs():
    with CommLog() as outer:
        dist.all_reduce(torch.ones(4))
        with CommLog() as inner:
            dist.broadcast(torch.ones(2), src=0)
        dist.barrier()
    return [r.op for r in outer.records], [r.op for r in inner.records]


def test_every_open_log_records_each_call():
    assert parakit.launch(two_logs, world_size=2) == [
        (["all_reduce", "broadcast", "barrier"], ["broadcast"])] * 2


def meta_and_real_all_reduce():
    with CommLog() as log:
        dist.all_reduce(torch.empty(1000, device="meta"))  # shape propagation: nothing moves
        dist.all_reduce(torch.ones(4))
    return [(r.op, r.nbytes) for r in log.records]


def test_calls_on_meta_tensors_are_not_recorded():
    assert parakit.launch(meta_and_real_all_reduce, world_size=2) == [[("all_reduce", 16)]] * 2


def rooted_calls_on_a_subgroup():
    group = dist.new_group([1, 2, 3])  # group ranks 0, 1, 2 are global ranks 1, 2, 3
    if dist.get_rank() == 0:
        return None
    with CommLog() as log:
        dist.broadcast(torch.ones(10), src=3, group=group)  # root: global 3, group rank 2
        dist.reduce(torch.ones(10), dst=3, group=group)
    return [(r.op, r.wire_bytes) for r in log.records]


def test_rooted_calls_on_a_subgroup_count_the_bytes_of_the_chain_from_the_root():
    # broadcast from group rank 2 runs the chain 2 -> 0 -> 1: group rank 1 (global 2) sends
    # nothing; reduce to group rank 2: the root sends nothing, the others send the tensor
    assert parakit.launch(rooted_calls_on_a_subgroup, world_size=4) == [
        None,
        [("broadcast", 40), ("reduce", 40)],
        [("broadcast", 0), ("reduce", 40)],
        [("broadcast", 40), ("reduce", 0)],
    ]


def send_while_another_thread_receives():
    with CommLog() as log:
        if dist.get_rank() == 0:
            receiver = threading.Thread(target=dist.recv, args=(torch.empty(3), 1))
            receiver.start()
            while comm.TRACKER.current is None:  # until the receiver thread is inside recv: two calls in flight
                time.sleep(0.001)
            dist.send(torch.ones(2), 1)
            receiver.join()
        else:
            dist.recv(torch.empty(2), 0)
            dist.send(torch.ones(3), 0)
    return sorted(r.op for r in log.records)


def quiet_while_the_launcher_asks_where_it_is():
    with CommLog() as log:
        time.sleep(1.5)  # past STATUS_AFTER, so the caller asks "where are you?" a few times
    return log.written_bytes(), comm.LAUNCHER_WRITES[0]


def test_written_bytes_leave_out_the_launchers_own_status_answers():
    """A rank that sends nothing writes nothing, though it answered the caller's status
    questions meanwhile (on a loaded machine every call runs long enough to be asked)."""
    for written, answered in parakit.launch(quiet_while_the_launcher_asks_where_it_is, world_size=2):
        assert written == 0 and answered > 0


def test_calls_from_two_threads_are_each_recorded():
    assert parakit.launch(send_while_another_thread_receives, world_size=2) == [["recv", "send"]] * 2


def gloo_worker_waits_for_gpu_after_a_log_and_a_cpu_all_reduce():
    before = comm._WAIT_FOR_GPU["on"]
    comm.install(wait_for_gpu=True)
    try:
        with CommLog() as log:  # entering a log installs the meter again: the setting stays
            x = torch.ones(3)
            dist.all_reduce(x)  # CPU tensors: nothing to wait for
        return before, comm._WAIT_FOR_GPU["on"], x, log.count("all_reduce")
    finally:
        comm.install(wait_for_gpu=False)


def test_waiting_for_the_gpu_is_off_on_gloo_and_kept_by_later_logs():
    """Under NCCL the launcher's workers make blocking calls wait for their GPU work; on gloo
    they do not, and opening a CommLog leaves the setting as it was."""
    for before, after, x, count in parakit.launch(gloo_worker_waits_for_gpu_after_a_log_and_a_cpu_all_reduce,
                                                  world_size=2):
        assert (before, after, count) == (False, True, 1)
        assert torch.equal(x, torch.full((3,), 2.0))


def test_ring_bytes_follow_the_documented_ring_model():
    assert ring_bytes("all_reduce", 400, 4) == 600  # 2(n-1)/n
    assert ring_bytes("all_reduce", 400, 1) == 0
    assert ring_bytes("reduce_scatter_single", 400, 4) == 300  # (n-1)/n of the full input
    assert ring_bytes("_reduce_scatter_base", 400, 4) == 300
    assert ring_bytes("all_to_all_single", 400, 4) == 300
    assert ring_bytes("all_gather_single", 100, 4) == 300  # (n-1) times its own input
    assert ring_bytes("_all_gather_base", 100, 4) == 300
    assert [ring_bytes("broadcast", 100, 4, rank, root=2) for rank in range(4)] == [100, 0, 100, 100]
    assert [ring_bytes("reduce", 100, 4, rank, root=2) for rank in range(4)] == [100, 100, 0, 100]
    assert [ring_bytes("gather", 100, 4, rank, root=1) for rank in range(4)] == [100, 0, 100, 100]
    assert [ring_bytes("scatter", 100, 4, rank, root=1) for rank in range(4)] == [0, 300, 0, 0]
    assert (ring_bytes("send", 100, 4), ring_bytes("isend", 100, 1)) == (100, 100)
    assert (ring_bytes("recv", 100, 4), ring_bytes("irecv", 100, 4), ring_bytes("barrier", 0, 4)) == (0, 0, 0)
    with pytest.raises(ValueError, match="no ring model for op 'frobnicate'"):
        ring_bytes("frobnicate", 100, 4)


# ---------------------------------------------------------------- ring all-reduce

SHAPES = [(1,), (3,), (7,), (1000,), (4, 6), (5, 3)]
DTYPES = [torch.float32, torch.float64]
OPS = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN,
       "PRODUCT": dist.ReduceOp.PRODUCT}


def chunk_bytes_sent(numel, n, rank, element_size):
    """What rank sends in the ring: chunk (rank - s) in reduce-scatter step s, chunk
    (rank + 1 - s) in all-gather step s, for s < n - 1; chunks as tensor_split makes them."""
    sizes = [len(c) for c in torch.arange(numel).tensor_split(n)]
    sent = [sizes[(rank - s) % n] for s in range(n - 1)] + [sizes[(rank + 1 - s) % n] for s in range(n - 1)]
    return sum(sent) * element_size


def ring_against_all_reduce(seed):
    """Every case on fresh random inputs: (case, max difference, ok flags, bytes sent)."""
    torch.manual_seed(seed + dist.get_rank())
    out = []
    for shape in SHAPES:
        for dtype in DTYPES:
            for name, op in OPS.items():
                x = torch.randn(shape, dtype=dtype)
                expected = x.clone()
                dist.all_reduce(expected, op=op)
                with CommLog() as log:
                    got = ring_all_reduce(x, op=op)
                case = (shape, str(dtype), name)
                out.append((case, got, expected, got is x, x.numel(), x.element_size(), log.count("isend"),
                            log.count("irecv"), log.wire_bytes("isend"), log.wire_bytes(), log.count()))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ring_all_reduce_equals_dist_all_reduce(world_size):
    n, seed = world_size, random.randrange(2**31)
    for rank, cases in enumerate(parakit.launch(ring_against_all_reduce, seed, world_size=n)):
        assert len(cases) == len(SHAPES) * len(DTYPES) * len(OPS)
        for case, got, expected, in_place, numel, element_size, isends, recvs, sent, wire, calls in cases:
            where = f"rank {rank}, case {case}, seed {seed}"
            assert in_place, where
            torch.testing.assert_close(got, expected, msg=lambda m: f"{where}: {m}")
            steps = 2 * (n - 1) if n > 1 else 0
            assert (isends, recvs, calls) == (steps, steps, 2 * steps), where
            assert sent == wire == chunk_bytes_sent(numel, n, rank, element_size), where


def ring_bytes_of_length(m, dtype):
    x = torch.ones(m, dtype=dtype)
    with CommLog() as log:
        ring_all_reduce(x)
    return log.wire_bytes("isend"), log.nbytes("isend"), log.nbytes("irecv")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ring_all_reduce_sends_two_n_minus_one_over_n_of_the_tensor(world_size, dtype):
    n, m = world_size, 1200  # divisible by n: every chunk is m/n elements
    total = m * torch.empty(0, dtype=dtype).element_size()
    expected = 2 * (n - 1) * total // n
    assert expected == ring_bytes("all_reduce", total, n)
    assert parakit.launch(ring_bytes_of_length, m, dtype, world_size=n) == [(expected, expected, expected)] * n


def ring_on_subgroup(members):
    group = dist.new_group(list(members))  # every rank takes part in creating the group
    x = torch.full((3, 5), float(dist.get_rank() + 1))
    if dist.get_rank() not in members:
        return x, []
    with CommLog() as log:
        ring_all_reduce(x, group=group)
    return x, [(r.op, r.group_size, r.rank, r.peer) for r in log.records]


@pytest.mark.parametrize("members", [(0, 1), (1, 3)])
def test_ring_all_reduce_on_a_subgroup_only_its_members_call(members):
    results = parakit.launch(ring_on_subgroup, members, world_size=4)
    total = float(sum(r + 1 for r in members))
    a, b = members
    for rank, (x, calls) in enumerate(results):
        if rank in members:
            torch.testing.assert_close(x, torch.full((3, 5), total))
            other = b if rank == a else a  # right and left neighbour, as global ranks
            # each step's send and receive posted together: isend to the right, irecv from the left
            assert calls == [("isend", 2, members.index(rank), other), ("irecv", 2, members.index(rank), other)] * 2
        else:
            torch.testing.assert_close(x, torch.full((3, 5), float(rank + 1)))
            assert calls == []


def ring_posts(numel):
    with recording() as posted:
        ring_all_reduce(torch.ones(numel))
    return posted


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_posts_each_steps_send_and_receive_in_one_batch_nccl_can_run(world_size):
    """Each of the 2(n-1) steps is one batch, its send to the right and receive from the left
    of one chunk each; no rank's send waits alone for a receive its neighbour posts later (the
    cycle of a ring whose ranks all send first, which NCCL's lazy pair set-up also makes)."""
    n, numel = world_size, 10  # chunks of 4, 3, 3 (n = 3): the bytes differ from step to step
    posted = parakit.launch(ring_posts, numel, world_size=n)
    sizes = [4 * len(c) for c in torch.arange(numel).tensor_split(n)]
    for rank, batches in enumerate(posted):
        moves = [m[rank] for _, m in comm.ring_schedule(n)]
        assert batches == [[("send", (rank + 1) % n, sizes[out]), ("recv", (rank - 1) % n, sizes[into])]
                           for out, into in moves]
    assert_nccl_can_run(posted)


def test_the_check_refuses_a_ring_whose_ranks_all_send_first():
    """The old ring's order: isend right, then recv left, each its own call."""
    n = 3
    with pytest.raises(AssertionError, match=r"NCCL would deadlock: rank 0 waits in batch 0: \[\('send', 1, 8\)\]; "
                                             r"rank 1 waits in batch 0: \[\('send', 2, 8\)\]"):
        assert_nccl_can_run([[[("send", (r + 1) % n, 8)], [("recv", (r - 1) % n, 8)]] * 2 for r in range(n)])


EMULATED_RING = '''import json, torch, torch.distributed as dist
import parakit
from parakit import comm

def ring(numel):
    x = torch.randn(numel, device=parakit.device())
    want = x.clone()
    dist.all_reduce(want)
    comm.ring_all_reduce(x)
    return torch.allclose(x, want), x.device.type

print(json.dumps({n: parakit.launch(ring, 10, world_size=n) for n in (3, 4)}))
'''


def test_ring_all_reduce_runs_on_the_emulated_nccl_at_3_and_4_ranks(tmp_path):
    """On emulated GPUs whose NCCL stops a ring whose ranks all send first (tests/test_emulation.py),
    the batched ring sums as dist.all_reduce does."""
    found = run_emulated(tmp_path, EMULATED_RING)
    assert found == {"3": [[True, "fgpu"]] * 3, "4": [[True, "fgpu"]] * 4}


def test_a_batch_of_meta_tensors_posts_nothing():
    """Shape propagation (pipeline.activation_shapes runs a stage with ring attention on the
    meta device) moves no bytes: batch_isend_irecv would ask the group for a meta backend."""
    before = comm.TRACKER.seq
    batch = comm.post_batch([("send", torch.empty(3, device="meta"), 1), ("recv", torch.empty(3, device="meta"), 1)])
    batch.wait()
    assert (batch.works, batch.calls, comm.TRACKER.seq) == ([], [], before)


def exchange_with_a_rank_that_left():
    if dist.get_rank() == 0:
        comm.post_batch([("send", torch.ones(1000), 1), ("recv", torch.empty(1000), 1)]).wait()


def test_a_rank_waiting_in_a_batch_is_named_by_the_hang_check():
    """post_batch's wait names the call it waits in, as a blocking call does: the launcher
    sees rank 0 wait for a message rank 1 (returned) never sent, and stops it."""
    with pytest.raises(CollectiveHang) as caught:
        parakit.launch(exchange_with_a_rank_that_left, world_size=2, timeout=45)
    text = str(caught.value)
    assert "rank 0 waits in irecv #2 (from rank 1)" in text and "rank 1 returned after 0 communication call(s)" in text
    assert parakit.launch(lambda: dist.get_rank(), world_size=2) == [0, 1]  # the pool still works


def test_ring_all_reduce_rejects_an_op_it_cannot_compute():
    def band():
        ring_all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.BAND)

    with pytest.raises(parakit.RankError, match="ring_all_reduce supports SUM, PRODUCT, MAX and MIN"):
        parakit.launch(band, world_size=2)


# ---------------------------------------------------------------- measured bytes

def tcp_bytes_written() -> int:
    """An independent count of what this process wrote: the kernel's TCP counters summed
    over its TCP sockets (tcp_info's bytes_sent less what it resent, bytes_retrans, plus bytes
    still queued, notsent_bytes). Resends happen on loopback under load (a full receive
    backlog drops a segment); wchar never counts them, so they are taken out here."""
    import os
    import socket
    import struct

    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
                sent, resent = struct.unpack_from("QQ", info, 200)
                total += sent - resent + struct.unpack_from("I", info, 144)[0]
        finally:
            sock.close()
    return total


MEGA = 1 << 20  # bytes per call


def measured_and_counted(op):
    """(CommLog's measured bytes, the TCP count, the model) for one 1 MiB call of `op`."""
    n = dist.get_world_size()
    x = torch.randn(MEGA // 4)
    calls = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: dist.all_gather_single(torch.empty(n * x.numel()), x),
        "reduce_scatter": lambda: dist.reduce_scatter_single(torch.empty(x.numel() // n), x),
        "broadcast": lambda: dist.broadcast(x, src=0),
    }
    dist.barrier()
    time.sleep(0.05)  # the barrier's own bytes have left
    before = tcp_bytes_written()
    with CommLog() as log:
        calls[op]()
    time.sleep(0.05)
    return log.measured_bytes(), tcp_bytes_written() - before, log.wire_bytes(), log.records[0].unmeasured


@pytest.mark.skipif(comm.written_bytes() is None, reason="no /proc/self/io on this platform")
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
def test_measured_bytes_match_the_kernels_tcp_count_within_two_percent(op, world_size):
    n = world_size
    for rank, (measured, counted, model, why) in enumerate(parakit.launch(measured_and_counted, op, world_size=n)):
        assert why == "" and measured is not None, (rank, why)
        assert abs(measured - counted) <= 0.02 * max(counted, 4096), (op, rank, measured, counted)
        if op in ("all_reduce", "all_gather"):  # gloo runs the ring: the model holds to 0.5% (message headers)
            assert abs(measured - model) <= 0.005 * model, (op, rank, measured, model)
        if op == "reduce_scatter":  # gloo reduces the whole tensor: twice the ring model
            assert abs(measured - 2 * model) <= 0.005 * model, (op, rank, measured, model)
        if op == "broadcast":  # a tree from rank 0: 2 children at the root, 1 at rank 1 on 4 ranks
            children = {2: [1, 0], 4: [2, 1, 0, 0]}[n][rank]
            assert abs(measured - children * MEGA) <= 0.005 * MEGA, (op, rank, measured)


def uneven_all_to_all(rows):
    """One all_to_all_single whose splits are this rank's row of `rows` (rows[i][j]: rank i
    to rank j), rows of 256 floats: (the record's model, the OS's bytes)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    received = [rows[j][rank] for j in range(n)]
    x = torch.randn(sum(rows[rank]), 256)
    with CommLog() as log:
        dist.all_to_all_single(x.new_empty(sum(received), 256), x, received, rows[rank])
    return log.records[0].wire_bytes, log.measured_bytes()


@pytest.mark.skipif(comm.written_bytes() is None, reason="no /proc/self/io on this platform")
def test_an_uneven_all_to_all_sends_exactly_the_rows_for_other_ranks():
    rows = [[7, 300, 0], [50, 2, 120], [10, 30, 500]]
    for rank, (model, measured) in enumerate(parakit.launch(uneven_all_to_all, rows, world_size=3)):
        others = 1024 * (sum(rows[rank]) - rows[rank][rank])  # what leaves the rank, not the (n-1)/n of the input
        assert model == others
        assert abs(measured - others) <= 0.02 * others, (rank, measured, others)


def without_proc_io():
    saved, comm._PROC_IO = comm._PROC_IO, "/nonexistent/io"
    try:
        with CommLog() as log:
            dist.all_reduce(torch.ones(10))
    finally:
        comm._PROC_IO = saved
    return log.measured_bytes(), log.unmeasured(), log.records[0].measured, log.written_bytes(), log.wire_bytes()


def test_measured_bytes_are_none_with_the_reason_where_the_os_gives_no_count():
    for measured, why, record, written, model in parakit.launch(without_proc_io, world_size=2):
        assert (measured, record, written, model) == (None, None, None, 40)
        assert why == "no /nonexistent/io on this platform: the OS gives no per-process write count"


def on_cuda():
    with CommLog() as log:
        dist.all_reduce(torch.ones(10, device=f"cuda:{dist.get_rank()}"))
    return log.measured_bytes(), log.unmeasured(), log.wire_bytes()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_measured_bytes_are_none_on_nccl_and_the_model_remains():
    for measured, why, model in parakit.launch(on_cuda, world_size=2, backend="nccl"):
        assert (measured, model) == (None, 40)
        assert why.startswith("CUDA tensors: NCCL moves them")


def isend_one_mebibyte():
    x = torch.randn(MEGA // 4)
    dist.barrier()
    time.sleep(0.05)
    before = tcp_bytes_written()
    with CommLog() as log:
        if dist.get_rank() == 0:
            dist.isend(x, 1).wait()
        else:
            dist.recv(x, 0)
    time.sleep(0.05)
    record = log.records[0]
    return record.measured, record.unmeasured, log.measured_bytes(), log.written_bytes(), tcp_bytes_written() - before


@pytest.mark.skipif(comm.written_bytes() is None, reason="no /proc/self/io on this platform")
def test_an_async_send_is_unmeasured_per_call_and_counted_by_the_block():
    (measured, why, total, written, counted), receiver = parakit.launch(isend_one_mebibyte, world_size=2)
    assert (measured, why, total) == (None, comm.ASYNC, None)
    assert abs(written - counted) <= 0.02 * counted and abs(written - MEGA) <= 0.005 * MEGA, (written, counted)
    assert receiver[0] is not None and receiver[1] == "" and receiver[0] < 4096  # a blocking recv writes ~nothing
