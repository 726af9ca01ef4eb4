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


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 00. The cheater hard-codes the byte counts, sums through rank 0 with send/recv
    instead of a ring, and uses reduce + broadcast for the two-phase exercise (each 0, the
    last two by the traffic check); the borrower calls parakit's answers (0 by the
    tripwires); `all_reduce_in_ring` calls dist.all_reduce inside the ring and loses that
    exercise only. The kernel hangs in the bytes exercise and dies in the two-phase one; in
    `rank_fails` a rank dies inside the ring and the two-phase all-reduce deadlocks (a rank
    receives what nobody sends), each found within seconds. Both lose the bytes exercise too:
    it checks the formula against the bytes the student's own ring sends. Then the hostile students of tests/hostile.py, each 0 on
    the exercise it attacks."""
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
    all_reduce_in_ring = {"ring_all_reduce": "def ring_all_reduce(tensor):\n    dist.all_reduce(tensor)\n    return tensor\n"}
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
                             {**pts, "test_ring_all_reduce": 0.0, "test_ring_bytes_per_rank": 0.0}),
               panel.Student("rank_fails", {name: panel.with_sources(full, rank_fails)},
                             {**pts, "test_ring_all_reduce": 0.0, "test_all_reduce_two_phase": 0.0,
                              "test_ring_bytes_per_rank": 0.0}),
               *hostile.students(lesson, solution)])


LESSON = panel.Lesson(REPO / "solutions" / "00_collectives.ipynb", students, timeout=40)
