"""Lesson 02's fake students."""
from pathlib import Path

import panel
from conftest import REPO

# Each wrong answer below gets the right gradients (to float rounding) and, where the test counts them, the right
# number of all-reduces inside backward and in all: only the calls one by one (kind, bytes) or their overlap with
# backward tell them apart.
NAIVE_IN_FLOAT64 = '''    def reduce_gradient(self, param):
        """Average param.grad over the ranks."""
        grad = param.grad.double()            # twice the bytes on the wire
        dist.all_reduce(grad)
        param.grad.copy_(grad / self.world_size)
'''

OVERLAP_BLOCKING = '''class MyOverlapDDP(MyNaiveDDP):
    def __init__(self, module):
        super().__init__(module)
        self.pending = []

    def reduce_gradient(self, param):
        dist.all_reduce(param.grad)           # blocking: backward waits for it
        self.pending.append(param)

    def finish_gradient_synchronization(self):
        for param in self.pending:
            param.grad.div_(self.world_size)
        self.pending.clear()
'''

OVERLAP_WAITED_IN_HOOK = '''class MyOverlapDDP(MyNaiveDDP):
    def __init__(self, module):
        super().__init__(module)
        self.pending = []

    def reduce_gradient(self, param):
        work = dist.all_reduce(param.grad, async_op=True)
        work.wait()                           # async, then waited at once: nothing overlaps
        self.pending.append((param, work))

    def finish_gradient_synchronization(self):
        for param, work in self.pending:
            work.wait()
            param.grad.div_(self.world_size)
        self.pending.clear()
'''

BUCKETS_AT_LAST_HOOK = '''    def reduce_gradient(self, param):
        self.ready[self.bucket_of[id(param)]] += 1
        if sum(self.ready) == sum(len(bucket) for bucket in self.buckets):   # every gradient is in: send them all
            for bucket in self.buckets:
                grads = [p.grad for p in bucket]
                flat = torch.cat([g.reshape(-1) for g in grads])
                self.pending.append((grads, flat, dist.all_reduce(flat, async_op=True)))
'''

NO_SYNC_DOES_NOTHING = '''@contextlib.contextmanager
def no_sync(self):
    yield                                     # every micro-batch's backward still all-reduces: the same sum


MyNaiveDDP.no_sync = no_sync
'''

# Right, written otherwise: full marks.
OTHERWISE = {
    "naive_ddp": '''class MyNaiveDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.sync = True
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, 0)
        for param in filter(lambda p: p.requires_grad, module.parameters()):
            param.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param):
        if self.sync:
            self.reduce_gradient(param)

    def reduce_gradient(self, param):
        param.grad.div_(self.world_size)      # divide first, then sum
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass
''',
    "flat_ddp": '''from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class MyFlatDDP(MyNaiveDDP):
    def reduce_gradient(self, param):
        pass

    def finish_gradient_synchronization(self):
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for g, average in zip(grads, _unflatten_dense_tensors(flat.div_(self.world_size), grads)):
            g.copy_(average)
''',
    "overlap_ddp": '''class MyOverlapDDP(MyNaiveDDP):
    def __init__(self, module):
        super().__init__(module)
        self.pending = []

    def reduce_gradient(self, param):
        self.pending.append((param, dist.all_reduce(param.grad, async_op=True)))

    def finish_gradient_synchronization(self):
        while self.pending:                   # waited in reverse order
            param, work = self.pending.pop()
            work.wait()
            param.grad.div_(self.world_size)
''',
    "bucketed_ddp": '''class MyBucketedDDP(MyNaiveDDP):
    """A buffer per bucket, filled as the gradients arrive, divided before the all-reduce, waited in reverse."""

    def __init__(self, module, bucket_size_mb=25.0):
        super().__init__(module)
        limit, self.buckets = bucket_size_mb * 2**20, []
        for param in [p for p in module.parameters() if p.requires_grad][::-1]:
            size = param.numel() * param.element_size()
            if not self.buckets or self.buckets[-1]["params"] and self.buckets[-1]["bytes"] + size > limit:
                self.buckets.append({"params": [], "bytes": 0})
            self.buckets[-1]["params"].append(param)
            self.buckets[-1]["bytes"] += size
        self.where = {}
        for bucket in self.buckets:
            bucket["buffer"] = torch.zeros(sum(p.numel() for p in bucket["params"]))
            bucket["waiting"] = set()
            start = 0
            for p in bucket["params"]:
                self.where[p] = (bucket, slice(start, start + p.numel()))
                start += p.numel()
        self.works = []

    def reduce_gradient(self, param):
        bucket, place = self.where[param]
        bucket["buffer"][place] = param.grad.reshape(-1) / self.world_size
        bucket["waiting"].add(param)
        if len(bucket["waiting"]) == len(bucket["params"]):
            self.works.append((bucket, dist.all_reduce(bucket["buffer"], async_op=True)))

    def finish_gradient_synchronization(self):
        for bucket, work in reversed(self.works):
            work.wait()
            for p in bucket["params"]:
                p.grad.copy_(bucket["buffer"][self.where[p][1]].view_as(p))
            bucket["waiting"].clear()
        self.works = []
''',
    "no_sync": '''class NoSync:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.previous, self.model.sync = self.model.sync, False

    def __exit__(self, *raised):
        self.model.sync = self.previous


def no_sync(self):
    return NoSync(self)


MyNaiveDDP.no_sync = no_sync
''',
}


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 02. The hard-coder divides by 2 instead of the world size in the naive, flat
    and overlapped wrappers and puts every parameter in one bucket (the visible tests run on
    2 ranks with 25 MiB buckets; the hidden ones on 4 ranks and tiny buckets: each 0); its
    no_sync is right, but the hidden no_sync test runs its naive wrapper on 4 ranks (0 too).
    The borrower wraps parakit's NaiveDDP, torch's DDP for the buckets and parakit's no_sync
    (each 0 by the tripwires). The kernel hangs in no_sync and dies in the overlapped wrapper.
    The student whose kernel hangs also gets the overlapped and bucketed averages right but
    sends them in finish_gradient_synchronization(), after backward (0 on both: no all-reduce
    inside backward; one notebook for both, to keep the panel's time).

    Wrong techniques with the right gradients and all-reduce counts, each 0 on its exercise:
    the student with missing cells (naive's tests deleted) also all-reduces blocking from the
    overlapped wrapper's hooks, launches every bucket at the last hook, and has a no_sync that
    does nothing (every micro-batch's backward all-reduces; the sum is the same); `wrong_technique`
    all-reduces float64 copies in the naive wrapper (twice the bytes; its no_sync test runs that
    wrapper, 0 too) and in the flat one, waits for each async all-reduce inside its hook, and
    fills its buckets in forward order (the same count, other bytes). `otherwise` is right
    and written differently (divides before the all-reduce, torch's flatten helpers, waits
    in reverse order, a buffer per bucket, a no_sync class): full marks."""
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

    def replaced(gid, start, end, new):
        """solved[gid] with the lines from the one starting `start` up to (not including) `end` replaced by `new`."""
        source = solved[gid]
        head, rest = source.split(start, 1)
        tail = rest.split(end, 1)[1] if end else ""
        return head + new + (end + tail if end else "")

    wrong = {
        "naive_ddp": replaced("naive_ddp", "    def reduce_gradient(self, param):", "    def forward(", NAIVE_IN_FLOAT64 + "\n"),
        "flat_ddp": solved["flat_ddp"].replace("flat = torch.cat([p.grad.reshape(-1) for p in params])",
                                               "flat = torch.cat([p.grad.reshape(-1) for p in params]).double()"),
        "overlap_ddp": OVERLAP_WAITED_IN_HOOK,
        "bucketed_ddp": solved["bucketed_ddp"].replace("reversed([p for p in module.parameters() if p.requires_grad])",
                                                       "[p for p in module.parameters() if p.requires_grad]"),
    }
    unhurried = {
        "overlap_ddp": OVERLAP_BLOCKING,
        "bucketed_ddp": replaced("bucketed_ddp", "    def reduce_gradient(self, param):",
                                 "    def finish_gradient_synchronization(self):", BUCKETS_AT_LAST_HOOK + "\n"),
        "no_sync": NO_SYNC_DOES_NOTHING,
    }
    assert all(wrong[gid] != solved[gid] for gid in wrong) and all(unhurried[g] != solved[g] for g in unhurried)
    students = panel.standard_panel(
        lesson, solution, hang_in="no_sync", crash_in="flat_ddp",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=borrowed,
        extra=[panel.Student("wrong_technique", {lesson.name: panel.with_sources(full, wrong)}, {}),
               panel.Student("otherwise", {lesson.name: panel.with_sources(full, OTHERWISE)}, dict(pts))])
    hang = next(s for s in students if s.name == "hang_and_crash")
    hang.files[lesson.name] = panel.with_sources(hang.files[lesson.name], deferred)
    hang.expected.update(test_overlap_ddp=0.0, test_bucketed_ddp=0.0)
    missing = next(s for s in students if s.name == "missing_cells")
    missing.files[lesson.name] = panel.with_sources(missing.files[lesson.name], unhurried)
    missing.expected.update(test_overlap_ddp=0.0, test_bucketed_ddp=0.0, test_no_sync=0.0)
    return students


LESSON = panel.Lesson(REPO / "solutions" / "02_ddp.ipynb", students, timeout=60)
