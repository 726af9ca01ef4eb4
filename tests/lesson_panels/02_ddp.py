"""Lesson 02's fake students."""
from pathlib import Path

import panel
from conftest import REPO


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 02. The hard-coder divides by 2 instead of the world size in the naive, flat
    and overlapped wrappers and puts every parameter in one bucket (the visible tests run on
    2 ranks with 25 MiB buckets; the hidden ones on 4 ranks and tiny buckets: each 0); its
    no_sync is right, but the hidden no_sync test runs its naive wrapper on 4 ranks (0 too).
    The borrower wraps parakit's NaiveDDP, torch's DDP for the buckets and parakit's no_sync
    (each 0 by the tripwires). The kernel hangs in no_sync and dies in the overlapped wrapper.
    The student whose kernel hangs also gets the overlapped and bucketed averages right but
    sends them in finish_gradient_synchronization(), after backward (0 on both: no all-reduce
    inside backward; one notebook for both, to keep the panel's time)."""
    full = panel.full_solution(panel.load(lesson), panel.load(solution))
    pts = panel.points(panel.load(lesson))
    solved = {panel.nbgrader_meta(c).get("grade_id"): c.source for c in full.cells}
    hardcoded = {gid: solved[gid].replace(average, average.replace("self.world_size", "2"))
                 for gid, average in (("naive_ddp", "div_(self.world_size)"), ("flat_ddp", "/= self.world_size"),
                                      ("overlap_ddp", "div_(self.world_size)"))}
    hardcoded["bucketed_ddp"] = solved["bucketed_ddp"].replace("cap, size = bucket_size_mb * 2**20, 0",
                                                               "cap, size = float('inf'), 0")
    assert all(hardcoded[gid] != solved[gid] for gid in hardcoded)
    borrowed = {
        "naive_ddp": "class MyNaiveDDP(ddp.NaiveDDP):\n    def __init__(self, module):\n"
                     "        super().__init__(module)\n        self.sync = True\n",
        "bucketed_ddp": "class MyBucketedDDP(nn.Module):\n    def __init__(self, module, bucket_size_mb=25.0):\n"
                        "        super().__init__()\n        self.inner = nn.parallel.DistributedDataParallel(module)\n"
                        "    def forward(self, *args):\n        return self.inner(*args)\n"
                        "    def finish_gradient_synchronization(self):\n        pass\n",
        "no_sync": "@contextlib.contextmanager\ndef no_sync(self):\n    with ddp.BucketedDDP.no_sync(self):\n"
                   "        yield\n\nMyNaiveDDP.no_sync = no_sync\n",
    }
    deferred = {gid: solved[gid].replace(launch, "None").replace("work.wait()", wait)
                for gid, launch, wait in (("overlap_ddp", "dist.all_reduce(param.grad, async_op=True)",
                                           "dist.all_reduce(param.grad)"),
                                          ("bucketed_ddp", "dist.all_reduce(flat, async_op=True)", "dist.all_reduce(flat)"))}
    assert all(deferred[gid] != solved[gid] for gid in deferred)
    students = panel.standard_panel(
        lesson, solution, hang_in="no_sync", crash_in="overlap_ddp",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=borrowed)
    hang = next(s for s in students if s.name == "hang")
    hang.files[lesson.name] = panel.with_sources(hang.files[lesson.name], deferred)
    hang.expected.update(test_overlap_ddp=0.0, test_bucketed_ddp=0.0)
    return students


LESSON = panel.Lesson(REPO / "solutions" / "02_ddp.ipynb", students, timeout=60)
