"""Lesson 00's fake students."""
from pathlib import Path

import hostile
import panel
from conftest import REPO

VIA_RANK_0 = """def ring_all_reduce(tensor):
    # right values, but a gather to rank 0 and back, not a ring
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        for peer in range(1, n):
            incoming = torch.empty_like(tensor)
            dist.recv(incoming, peer)
            tensor += incoming
        for peer in range(1, n):
            dist.send(tensor, peer)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)
    return tensor
"""

CHAIN = """def ring_all_reduce(tensor):
    # right values and only right-neighbour sends, as many bytes in all as the ring, but not a ring: the sum
    # runs along the chain 0 -> 1 -> ... -> n-1 in whole tensors, then around again to every rank
    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    if n == 1:
        return tensor
    if rank > 0:
        incoming = torch.empty_like(tensor)
        dist.recv(incoming, left)
        tensor += incoming
    if rank < n - 1:
        dist.send(tensor, right)
    if rank != n - 1:
        dist.recv(tensor, left)
    if rank != n - 2:
        dist.send(tensor, right)
    return tensor
"""

WHOLE_TENSORS = """def ring_all_reduce(tensor):
    # a ring that passes whole tensors: n-1 steps of the whole tensor, (n-1) M bytes a rank instead of 2(n-1)/n M
    n, rank = dist.get_world_size(), dist.get_rank()
    passing, total = tensor.clone(), tensor.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(passing)
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, passing, (rank + 1) % n),
                                               dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]):
            request.wait()
        total += incoming
        passing = incoming
    tensor.copy_(total)
    return tensor
"""

GATHER_AND_SUM = """def all_reduce_two_phase(tensor):
    # right values, but every rank all-gathers every whole tensor and sums them: no reduce-scatter
    n = dist.get_world_size()
    flat = tensor.reshape(-1).contiguous()
    everything = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
    dist.all_gather_single(everything, flat)
    tensor.copy_(everything.view(n, -1).sum(0).view_as(tensor))
    return tensor
"""

RECEIVE_FIRST = """def ring_all_reduce(tensor):
    # the ring with each step's receive first in its batch, and empty chunks not sent at all
    n, rank = dist.get_world_size(), dist.get_rank()
    if n == 1:
        return tensor
    flat = tensor.reshape(-1).clone()
    chunks = flat.tensor_split(n)

    def exchange(send, recv):
        ops = [dist.P2POp(dist.irecv, recv, (rank - 1) % n)] if recv.numel() else []
        ops += [dist.P2POp(dist.isend, send, (rank + 1) % n)] if send.numel() else []
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()

    for step in range(n - 1):
        mine = chunks[(rank - step - 1) % n]
        incoming = torch.empty_like(mine)
        exchange(chunks[(rank - step) % n], incoming)
        mine += incoming
    for step in range(n - 1):
        exchange(chunks[(rank + 1 - step) % n], chunks[(rank - step) % n])
    tensor.copy_(flat.view_as(tensor))
    return tensor
"""

LISTS = """def all_reduce_two_phase(tensor):
    # the same two collectives through their list forms
    n = dist.get_world_size()
    flat = tensor.reshape(-1)
    size = -(-flat.numel() // n)
    pieces = list(torch.nn.functional.pad(flat, (0, n * size - flat.numel())).chunk(n))
    mine = torch.empty(size, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter(mine, pieces)
    dist.all_gather(pieces, mine)
    tensor.copy_(torch.cat(pieces)[: flat.numel()].view_as(tensor))
    return tensor
"""

# The ring's bytes from ZeRO's stage-0 formula (2 (N-1)/N of the bytes): a general helper that
# nothing withholds; the exercise's allowlist does not name it.
ZERO_FORMULA = ("def ring_bytes_per_rank(nbytes, world_size):\n    from parakit.zero import paper\n"
                "    return paper.zero_comm_bytes(nbytes, world_size, 0, element_bytes=1)\n")


CPU_BUFFERS = """def all_reduce_two_phase(tensor):
    n = dist.get_world_size()
    flat = tensor.reshape(-1)
    size = -(-flat.numel() // n)
    padded = torch.zeros(n * size, dtype=flat.dtype)   # on the CPU, wherever the tensor lives
    padded[: flat.numel()] = flat
    piece = torch.empty(size, dtype=flat.dtype)
    dist.reduce_scatter_single(piece, padded)
    dist.all_gather_single(padded, piece)
    tensor.copy_(padded[: flat.numel()].view_as(tensor))
    return tensor
"""


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 00. The cheater hard-codes the byte counts, sums through rank 0 with send/recv
    instead of a ring, and uses reduce + broadcast for the two-phase exercise (each 0, the
    last two by the traffic check); the borrower calls parakit's answers (0 by the
    tripwires); `all_reduce_in_ring` calls dist.all_reduce inside the ring and makes the two-phase
    buffers on the CPU (right on gloo, 0 by the emulated GPU box's hidden case, where NCCL
    refuses a CPU tensor). The kernel hangs in the bytes exercise and dies in the two-phase one; in
    `rank_fails` a rank dies inside the ring and the two-phase all-reduce deadlocks (a rank
    receives what nobody sends), each found within seconds. Both lose the bytes exercise too:
    it checks the formula against the bytes the student's own ring sends. Techniques: `chain_ring` sends only to
    its right neighbour and as many bytes in all as the ring, but whole tensors along a chain (0 on the ring by
    each rank's calls one by one, and on the bytes), and its two-phase all-reduce all-gathers every tensor and
    sums (0); `whole_tensor_ring` passes whole tensors around the ring (0 on the ring and the bytes) and uses the
    list forms of the two collectives (full marks there); `ring_receive_first` (each step's receive first in its
    batch, empty chunks skipped) keeps full marks. (A ring by parity, even ranks sending first with blocking calls, also
    passes: the test accepts it; it is left out of the panel, which already takes lesson 00 near its time limit.)
    Then the hostile students of tests/hostile.py, each 0
    on the exercise it attacks."""
    full = panel.full_solution(panel.load(lesson), panel.load(solution))
    name, pts = lesson.name, panel.points(panel.load(lesson))
    cheats = {
        "ring_bytes_per_rank": "def ring_bytes_per_rank(nbytes, world_size):\n"
                               "    return {(1024, 2): 1024.0, (4096, 4): 6144.0, (2**20, 8): 1835008.0}[(nbytes, world_size)]\n",
        "ring_all_reduce": VIA_RANK_0,
        "all_reduce_two_phase": "def all_reduce_two_phase(tensor):\n    dist.reduce(tensor, 0)\n"
                                "    dist.broadcast(tensor, 0)\n    return tensor\n",
    }
    borrowed = {
        "ring_bytes_per_rank": "def ring_bytes_per_rank(nbytes, world_size):\n"
                               "    return float(comm.ring_bytes('all_reduce', nbytes, world_size))\n",
        "ring_all_reduce": "def ring_all_reduce(tensor):\n    return comm.ring_all_reduce(tensor)\n",
        "all_reduce_two_phase": "def all_reduce_two_phase(tensor):\n    return comm.all_reduce_two_phase(tensor)\n",
    }
    all_reduce_in_ring = {"ring_all_reduce": "def ring_all_reduce(tensor):\n    dist.all_reduce(tensor)\n    return tensor\n",
                          "all_reduce_two_phase": CPU_BUFFERS}
    rank_fails = {
        "ring_all_reduce": "def ring_all_reduce(tensor):\n    import os\n    if dist.get_rank() == 1:\n"
                           "        os._exit(1)\n    return tensor\n",
        "all_reduce_two_phase": "def all_reduce_two_phase(tensor):\n    if dist.get_rank() == 1:\n"
                                "        dist.recv(tensor, 0)\n    return tensor\n",
    }
    return panel.standard_panel(
        lesson, solution, hang_in="ring_bytes_per_rank", crash_in="all_reduce_two_phase",
        hardcoded=cheats, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=borrowed,
        extra=[panel.Student("all_reduce_in_ring", {name: panel.with_sources(full, all_reduce_in_ring)},
                             {**pts, "test_ring_all_reduce": 0.0, "test_ring_bytes_per_rank": 0.0,
                              "test_all_reduce_two_phase": 0.0}),
               panel.Student("rank_fails", {name: panel.with_sources(full, rank_fails)},
                             {**pts, "test_ring_all_reduce": 0.0, "test_all_reduce_two_phase": 0.0,
                              "test_ring_bytes_per_rank": 0.0}),
               panel.Student("general_helper", {name: panel.with_sources(full, {"ring_bytes_per_rank": ZERO_FORMULA})},
                             {**pts, "test_ring_bytes_per_rank": 0.0}),
               panel.Student("chain_ring", {name: panel.with_sources(
                   full, {"ring_all_reduce": CHAIN, "all_reduce_two_phase": GATHER_AND_SUM})}, {}),
               panel.Student("whole_tensor_ring", {name: panel.with_sources(
                   full, {"ring_all_reduce": WHOLE_TENSORS, "all_reduce_two_phase": LISTS})},
                             {"test_all_reduce_two_phase": pts["test_all_reduce_two_phase"]}),
               panel.Student("ring_receive_first", {name: panel.with_sources(full, {"ring_all_reduce": RECEIVE_FIRST})},
                             dict(pts)),
               *hostile.students(lesson, solution)])


LESSON = panel.Lesson(REPO / "solutions" / "00_collectives.ipynb", students, timeout=40)
