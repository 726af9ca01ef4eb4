"""The sealed judge's parts, each on real processes: the plain-data codec, the relay that
sees every message, the jail a student's rank runs in, and the withheld functions."""
from __future__ import annotations

import os
import random
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from parakit import comm
from parakit.grading import codec, sandbox
from parakit.grading.judge import JudgeConfig, Runner, StudentName

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test file


@pytest.fixture(scope="module")
def runner():
    runner = Runner(JudgeConfig(hidden=[os.path.dirname(comm.__file__)]))
    yield runner
    runner.close()


def run(runner, fn, world_size=2, cells=(), locked=False, forbid=(), timeout=30.0, gpu=False):
    """fn(rank) on fresh ranks after `cells` (student cells), on the emulated GPU box where `gpu`; the Run."""
    job = sandbox.Job(cloudpickle.dumps((fn, [()])), True, [(f"<cell {i}>", c, True) for i, c in enumerate(cells)],
                      cloudpickle.dumps(list(forbid)), locked, runner.config.hidden, gpu=gpu)
    return runner.run(job, world_size, timeout)


# ---------------------------------------------------------------------------- codec

def test_codec_round_trips_plain_data_exactly():
    value = {"a": [1, 2.5, float("nan")], (1, "k"): (torch.arange(6, dtype=torch.int16).view(2, 3),),
             "p": torch.nn.Parameter(torch.randn(3)), "b": torch.tensor([True, False]), 7: torch.zeros(0, 2),
             "bf": torch.randn(4).bfloat16()}
    plain = {"s": ["x", None, True], "big": 2**70, "t": ((), [])}
    back = codec.decode(*codec.encode({**value, **plain}))
    assert type(back["p"]) is torch.nn.Parameter and type(back[(1, "k")][0]) is torch.Tensor
    torch.testing.assert_close({k: back[k] for k in value}, value, equal_nan=True)
    assert {k: back[k] for k in plain} == plain and back[7].shape == (0, 2)


@pytest.mark.parametrize("value, named", [(torch.randn(2).as_subclass(torch.nn.Buffer), "torch.nn.parameter.Buffer"),
                                          ({1, 2}, "builtins.set"), (object(), "builtins.object")])
def test_codec_refuses_what_is_not_plain_data_naming_it(value, named):
    with pytest.raises(codec.CodecError, match=f"the result\\[1\\] is a {named}: only None"):
        codec.encode([0, value])


@pytest.mark.parametrize("header, payload, why", [
    ({"value": {"tensor": {"dtype": "float32", "shape": [4]}, "at": 0, "parameter": False}}, b"1234", "past the end"),
    ({"value": {"tensor": {"dtype": "object", "shape": [1]}, "at": 0, "parameter": False}}, b"", "description"),
    ({"value": {"pickle": "gASVIQAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOUjAJsc5SFlFKULg=="}}, b"", "kind 'pickle'"),
    ({"value": {"list": [{"list": []}] * 2}}, b"", None),
    ({"nothing": 1}, b"", "no value"),
])
def test_codec_decodes_only_its_own_frames(header, payload, why):
    if why is None:
        assert codec.decode(header, payload) == [[], []]
        return
    with pytest.raises(codec.CodecError, match=why):
        codec.decode(header, payload)


# ---------------------------------------------------------------------------- relay

def collectives(_=None):
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.full((4,), float(rank))
    dist.all_reduce(x)
    out = torch.empty(2)
    dist.reduce_scatter_single(out, torch.arange(4.0) * (rank + 1))
    gathered = torch.empty(2 * n)
    dist.all_gather_single(gathered, out)
    if rank == 0:
        dist.send(torch.ones(3), 1)
    else:
        got = torch.empty(3)
        dist.recv(got, 0)
    return [x, gathered]


def test_relay_computes_collectives_and_records_every_call_with_its_bytes(runner):
    result = run(runner, collectives)
    assert result.failure is None
    for rank in range(2):
        x, gathered = result.values[rank][0]["value"]
        assert x.tolist() == [1.0] * 4 and gathered.tolist() == [0.0, 3.0, 6.0, 9.0]
    calls = [[(c.op, c.peer, c.nbytes, c.wire_bytes) for c in r] for r in result.calls]
    assert calls[0] == [("all_reduce", None, 16, 16), ("reduce_scatter", None, 16, 8), ("all_gather", None, 8, 8),
                        ("send", 1, 12, 12)]
    assert calls[1][-1] == ("recv", 0, 12, 0)


def test_relay_sees_the_process_groups_own_methods(runner):
    result = run(runner, lambda: dist.group.WORLD.allreduce([torch.ones(2)]).wait())
    assert [c.op for c in result.calls[0]] == ["all_reduce"]


def test_relay_names_ranks_in_different_collectives_at_once(runner):
    def mismatched():
        x = torch.ones(1)
        dist.all_reduce(x) if dist.get_rank() == 0 else dist.broadcast(x, 0)
    result = run(runner, mismatched)
    assert result.failure.startswith("collective mismatch on group (0, 1): its call #1 is all_reduce on rank 0, "
                                     "broadcast on rank 1.")


def test_relay_reports_a_rank_waiting_on_one_that_returned(runner):
    def waits():
        if dist.get_rank() == 1:
            dist.recv(torch.empty(1), 0)
    result = run(runner, waits)
    # which of the two sees it first depends on whether rank 0's result or its hang-up comes first
    assert result.failure == "rank 1 waits in recv from rank 0, but rank 0 has already returned or died" \
        or "rank 1 waits for its recv from rank 0" in result.failure and "rank 0 has left the launched" in result.failure


def test_relay_reports_ranks_waiting_on_each_other_as_a_deadlock(runner):
    def both_receive():
        dist.recv(torch.empty(1), 1 - dist.get_rank())
    result = run(runner, both_receive, timeout=30)
    assert result.failure.startswith("emulated NCCL: ranks 0, 1 wait for operations that can never run")
    assert "rank 0 waits for its recv from rank 1\n  rank 1 waits for its recv from rank 0" in result.failure


def ring(batched):
    """Each rank's block to the next rank and the previous one's received, posted together or apart."""
    def shift():
        rank, n = dist.get_rank(), dist.get_world_size()
        mine, theirs = torch.full((2,), float(rank)), torch.empty(2)
        if batched:
            ops = [dist.P2POp(dist.isend, mine, (rank + 1) % n), dist.P2POp(dist.irecv, theirs, (rank - 1) % n)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        else:
            work = dist.isend(mine, (rank + 1) % n)
            dist.recv(theirs, (rank - 1) % n)
            work.wait()
        return theirs
    return shift


def test_relay_runs_a_ring_by_nccls_rules_batched_it_runs_posted_apart_it_hangs(runner):
    result = run(runner, ring(batched=True), world_size=3)
    assert result.failure is None
    assert [v[0]["value"].tolist() for v in result.values] == [[2.0] * 2, [0.0] * 2, [1.0] * 2]
    assert [[(c.op, c.peer, c.batch) for c in r] for r in result.calls] == [
        [("send", 1, 0), ("recv", 2, 0)], [("send", 2, 0), ("recv", 0, 0)], [("send", 0, 0), ("recv", 1, 0)]]
    # gloo runs it (the send is buffered); under NCCL every send waits for its receive, posted after it
    result = run(runner, ring(batched=False), world_size=3)
    assert result.failure.startswith("emulated NCCL: ranks 0, 1, 2 wait for operations that can never run")
    assert "rank 0's stream on group (0, 1, 2) runs, in order: send to rank 1, recv from rank 2" in result.failure
    assert all(c.batch is None for r in result.calls for c in r)


def test_relay_records_which_calls_were_in_flight_together(runner):
    def two_at_once_then_one():
        a, b, c = torch.ones(2), torch.ones(3), torch.ones(1)
        first, second = dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)
        second.wait()
        dist.broadcast(c, 0)            # blocking, while the first is still not waited for
        first.wait()
        dist.all_reduce(c)              # nothing in flight
    result = run(runner, two_at_once_then_one)
    assert result.failure is None
    for calls in result.calls:
        assert [(c.op, c.alongside) for c in calls] == [("all_reduce", ()), ("all_reduce", (0,)), ("broadcast", (0,)),
                                                        ("all_reduce", ())]
    batched = run(runner, ring(batched=True), world_size=3)
    assert all([c.alongside for c in calls] == [(), (0,)] for calls in batched.calls)  # a batch's parts, together


def test_relay_runs_blocking_sends_and_receives_in_an_order_that_meets(runner):
    def parity():
        rank, n = dist.get_rank(), dist.get_world_size()
        mine, theirs = torch.full((2,), float(rank)), torch.empty(2)
        if rank % 2 == 0:
            dist.send(mine, (rank + 1) % n)
            dist.recv(theirs, (rank - 1) % n)
        else:
            dist.recv(theirs, (rank - 1) % n)
            dist.send(mine, (rank + 1) % n)
        return theirs
    result = run(runner, parity, world_size=4)
    assert result.failure is None
    assert [v[0]["value"][0].item() for v in result.values] == [3.0, 0.0, 1.0, 2.0]


def on_the_gpu_box(where):
    """On the emulated box: this rank's device and generator, a collective on tensors made
    `where` ("device": parakit.device(), "cpu", "next": the next rank's GPU) and an object one."""
    def run_there():
        import parakit
        rank, n = dist.get_rank(), dist.get_world_size()
        here = parakit.device()
        made = {"device": here, "cpu": torch.device("cpu"), "next": torch.device(here.type, (rank + 1) % n)}[where]
        x = torch.full((3,), float(rank + 1), device=made)
        dist.all_reduce(x)
        names = [None] * n
        dist.all_gather_object(names, str(here))
        torch.manual_seed(0)
        return str(here), x.cpu(), torch.rand(2, device=here).cpu(), torch.rand(2), names
    return run_there


def test_on_the_gpu_box_each_rank_computes_on_its_gpu_and_a_call_off_it_fails_as_under_nccl(runner):
    result = run(runner, on_the_gpu_box("device"), gpu=True)
    assert result.failure is None
    cpu_draw = torch.rand(2, generator=torch.Generator().manual_seed(0))
    for rank, value in enumerate(result.values):
        device, x, drawn_there, drawn_on_cpu, names = value[0]["value"]
        assert device == f"fgpu:{rank}" and x.tolist() == [3.0] * 3 and names == ["fgpu:0", "fgpu:1"]
        assert torch.equal(drawn_on_cpu, cpu_draw) and not torch.equal(drawn_there, cpu_draw)  # the GPU's own generator
        assert torch.equal(drawn_there, result.values[0][0]["value"][2])  # seeded alike by manual_seed on every rank
    assert [c.op for c in result.calls[0]] == ["all_reduce", "all_gather", "all_gather"]
    cpu, other = (run(runner, on_the_gpu_box(where), gpu=True).values[0][0]["error"] for where in ("cpu", "next"))
    assert cpu.startswith("RuntimeError: No backend type associated with device type cpu: all_reduce on rank 0 got a "
                          "tensor on cpu, but under NCCL this rank's tensors live on fgpu:0")
    assert other.startswith("ValueError: all_reduce on rank 0 got a tensor on fgpu:1, but this rank's NCCL "
                            "communicator is on fgpu:0 (one device per rank)")


# ---------------------------------------------------------------------------- jail and withheld functions

ATTEMPTS = {
    "start a process": "import subprocess\nsubprocess.run(['true'])",
    "fork": "import os\nos.fork()",
    "open a socket": "import socket\nsocket.socket()",
    "write outside": "open('/tmp/parakit-sealed-escape', 'w').write('x')",
    "read the course": f"open({comm.__file__!r}).read()",
    "ctypes": "import ctypes\nctypes.pythonapi.Py_GetVersion()",
    "new code": "def f():\n    pass\nf.__code__ = (lambda: 1).__code__",
    "another process's memory": "open('/proc/2/environ').read()",  # confined, the rank itself is 1
}


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu_box"])
def test_a_locked_rank_is_refused_each_way_out_while_its_scratch_folder_works(runner, gpu):
    scratch = ("<scratch>", "open('mine.txt', 'w').write('ok')\nimport os, tempfile\n"  # tempfile's folders too
               "assert os.path.dirname(tempfile.mkdtemp()) == os.getcwd()\n"
               "import torch, parakit\n"  # on the GPU box, its tensors (made through ctypes by fgpu itself) work
               f"assert (torch.ones(2, device=parakit.device()) * 2).device.type == {'fgpu' if gpu else 'cpu'!r}", True)
    cells = [scratch, *((k, v, True) for k, v in ATTEMPTS.items())]
    job = sandbox.Job(cloudpickle.dumps((int, [])), True, cells, b"", True, runner.config.hidden, report_cells=True,
                      gpu=gpu)
    notes = runner.run(job, 1, 30).notes[0]
    assert notes[0] == "cell 0 ok" and len(notes) == len(cells), notes[0]
    for what, note in zip(ATTEMPTS, notes[1:]):
        assert "error Refused: a graded process may " in note, (what, note)
    assert not os.path.exists("/tmp/parakit-sealed-escape")


def borrow_every_way():
    import importlib
    import threading
    seen = []
    for call in (lambda: comm.ring_all_reduce(torch.ones(1)),
                 lambda: importlib.import_module("parakit.comm").ring_all_reduce(torch.ones(1))):
        box = []
        thread = threading.Thread(target=lambda: box.append(_outcome(call)))
        thread.start()
        thread.join()
        seen += [_outcome(call), box[0]]
    return seen


def _outcome(call):
    try:
        call()
    except AssertionError as error:
        return str(error)
    return "ran"


def test_a_withheld_function_trips_by_any_route_and_the_judge_hears_of_it(runner):
    result = run(runner, borrow_every_way, world_size=1, locked=True,
                 forbid=[(comm.ring_all_reduce, "you called it")])
    assert result.values[0][0]["value"] == ["you called it"] * 4
    assert result.notes[0] == ["tripped: you called it"] * 4


def test_a_student_name_cannot_be_called_in_the_judge_and_resolves_in_a_students_rank(runner):
    proxy = StudentName(("helper",))
    with pytest.raises(RuntimeError, match="helper is the student's code: the sealed judge never runs it"):
        proxy(1)
    job = sandbox.Job(cloudpickle.dumps((lambda x: proxy(x) * 2, [(21,)])), True,
                      [("<answer>", "def helper(x):\n    return x", True)], b"", True, runner.config.hidden)
    assert runner.run(job, 1, 30).values[0] == [{"value": 42}]
    reference = sandbox.Job(cloudpickle.dumps((lambda x: proxy(x), [(1,)])), True)
    assert "only a student's process can run it" in runner.run(reference, 1, 30).values[0]["error"]


def test_a_rank_that_leaves_a_process_behind_is_cleaned_up(runner, tmp_path):
    pid_file = tmp_path / "orphan.pid"
    cell = (f"import os, time\nif os.fork() == 0:\n    open('pid', 'w').write(str(os.getpid()))\n"
            f"    os.rename('pid', {str(pid_file)!r})\n    time.sleep(300)\n"
            f"while not os.path.exists({str(pid_file)!r}):\n    time.sleep(0.01)")
    run(runner, lambda: None, world_size=1, cells=[cell])   # not locked: the fork succeeds
    from conftest import wait_gone
    assert pid_file.exists() and wait_gone([int(pid_file.read_text())]) == []  # polls; 60 s bounds a hang


def takes(seconds):
    def inputs(r):
        return (seconds,)
    return inputs


def sleep_then_one(seconds):
    import time
    time.sleep(seconds)
    return 1


def test_a_check_waits_ten_times_the_references_time_so_a_slowed_right_answer_keeps_its_marks(runner):
    """The reference takes about 1 s here; a check with a 0.5 s timeout still lets the student
    take 2 s (a loaded machine slows both alike), and refuses one that takes 60."""
    from parakit.grading.judge import Sealed
    student = Runner(JudgeConfig())
    try:
        sealed = Sealed(runner, student, [], [], {}, [])
        slow = lambda seconds: sleep_then_one(2 * seconds)  # noqa: E731
        sealed.check(slow, sleep_then_one, takes(1.0), world_sizes=(1,), allow=[], trials=1, timeout=0.5)
        never = lambda seconds: sleep_then_one(60 * seconds)  # noqa: E731
        with pytest.raises(AssertionError, match=r"did not finish within 1\d\.\d+ s"):
            sealed.check(never, sleep_then_one, takes(1.0), world_sizes=(1,), allow=[], trials=1, timeout=0.5)
    finally:
        student.close()


def test_a_hung_check_costs_the_judges_floor_not_the_checks_60_s_timeout(runner):
    """The judge cuts a check's timeout (60 s by default) to its floor (JudgeConfig.cell_floor,
    3 s here): beside a 0.1 s reference, an answer that takes 1 s keeps its marks and one that
    hangs is cut at the floor."""
    from parakit.grading.judge import Sealed
    student = Runner(JudgeConfig())
    try:
        sealed = Sealed(runner, student, [], [], {}, [], floor=3.0)
        sealed.check(lambda seconds: sleep_then_one(10 * seconds), sleep_then_one, takes(0.1), world_sizes=(1,),
                     allow=[], trials=1)
        with pytest.raises(AssertionError, match=r"did not finish within 3(\.0+)? s"):
            sealed.check(lambda seconds: sleep_then_one(600 * seconds), sleep_then_one, takes(0.1), world_sizes=(1,),
                         allow=[], trials=1)
    finally:
        student.close()


def test_a_reference_time_kept_from_a_quieter_moment_is_measured_again_before_a_slow_answer_loses(runner):
    """The reference's result and time are kept for the class; where its kept time is from a
    quieter moment (here set to 0.01 s for a reference that takes 0.4 s: the machine has
    slowed since), a right answer that runs out of the kept limit (the 1 s floor) is run again
    under ten times the reference's time now, and keeps its marks; a hang is still cut."""
    from parakit.grading.judge import Sealed
    student = Runner(JudgeConfig())
    try:
        sealed = Sealed(runner, student, [], [], {}, [], floor=1.0)
        random.seed(0)  # as the judge seeds each test cell: the same inputs, so the reference's kept run
        sealed.check(sleep_then_one, sleep_then_one, takes(0.4), world_sizes=(1,), allow=[], trials=1)
        (key, (run, _)), = sealed.cache.items()
        sealed.cache[key] = (run, 0.01)
        random.seed(0)
        sealed.check(lambda seconds: sleep_then_one(5 * seconds), sleep_then_one, takes(0.4), world_sizes=(1,),
                     allow=[], trials=1)
        assert sealed.cache[key][1] >= 0.4
        random.seed(0)
        with pytest.raises(AssertionError, match=r"did not finish within"):
            sealed.check(lambda seconds: sleep_then_one(600 * seconds), sleep_then_one, takes(0.4), world_sizes=(1,),
                         allow=[], trials=1)
    finally:
        student.close()


def gradients_reduced(how: str, sizes):
    """A tiny MLP's backward on this rank, its gradients all-reduced `how`: "async" (each as its
    hook fires, waited after backward), "async_reversed" (the same, waited in reverse),
    "async_future" (the same, waited on the Work's future),
    "blocking" (each waited in its hook), "last_hook" (all started at the last hook)."""
    import torch
    import torch.distributed as dist
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])
    params, pending, ready = list(net.parameters()), [], []

    def hook(param):
        if how == "blocking":
            dist.all_reduce(param.grad)
        elif how == "async_future":
            pending.append(dist.all_reduce(param.grad, async_op=True).get_future())
        elif how.startswith("async"):
            pending.append(dist.all_reduce(param.grad, async_op=True))
        else:
            ready.append(param)
            if len(ready) == len(params):
                pending.extend(dist.all_reduce(p.grad, async_op=True) for p in ready)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    net(torch.ones(2, sizes[0]) * (dist.get_rank() + 1)).square().sum().backward()
    for work in (reversed(pending) if how == "async_reversed" else pending):
        work.wait()
    return [p.grad for p in params]


def overlap_inputs(how):
    def inputs(r):
        return how, [r.randint(2, 6) for _ in range(3)]
    return inputs


def test_the_relay_sees_which_calls_overlapped_the_backward_and_a_check_can_ask_for_it(runner):
    from parakit.grading.judge import Sealed
    student = Runner(JudgeConfig())
    try:
        sealed = Sealed(runner, student, [], [], {}, [])
        for right in ("async", "async_reversed", "async_future"):  # other valid waits keep full marks
            sealed.check(lambda how, sizes: gradients_reduced(right, sizes), gradients_reduced, overlap_inputs("async"),
                         world_sizes=(2,), allow=[], trials=1, same_traffic=True, same_overlap=True)
        for wrong in ("blocking", "last_hook"):  # the right values and traffic, no overlap
            with pytest.raises(AssertionError, match=r"rank 0: 0 of its 4 calls were in flight while the backward "
                                                     r"went on; the reference's 3 of 4"):
                sealed.check(lambda how, sizes: gradients_reduced(wrong, sizes), gradients_reduced,
                             overlap_inputs("async"), world_sizes=(2,), allow=[], trials=1, same_traffic=True,
                             same_overlap=True)
    finally:
        student.close()


def test_a_rank_that_floods_its_output_is_stopped_at_the_cap_with_one_line_and_the_next_run_works(runner):
    flood = "import sys\nwhile True:\n    sys.stdout.write('x' * 2**20)\n"
    result = run(runner, lambda: None, world_size=2, cells=[flood], locked=True)
    assert result.failure == "rank 0 ended without a result: its process died: it wrote 8 MiB of output, " \
                             "the most a rank may write, and was stopped"
    assert run(runner, lambda: 1, world_size=2).values == [[{"value": 1}], [{"value": 1}]]  # one case each


def through_the_chain(n):
    """What checkpoint_sequential's helper computes: n identity layers run as one chain."""
    import torch
    from parakit import checkpoint
    return checkpoint._chain([torch.nn.Identity()] * n, 0)(torch.ones(2))


def ones(n):
    import torch
    return torch.ones(2)


def test_what_only_a_forbidden_function_uses_is_withheld_with_it(runner):
    """checkpoint_sequential forbidden: _chain, which nothing else in parakit names, is withheld
    too (a student who calls it trips), unless the instructor's cells name it; checkpoint,
    which Checkpointed and others use, is not."""
    from parakit import checkpoint
    from parakit.grading import reach
    from parakit.grading.jail import Tripwire
    from parakit.grading.judge import Sealed
    derived = reach.only_used_by([checkpoint.checkpoint_sequential], [])
    assert checkpoint._chain in derived and checkpoint.checkpoint not in derived
    assert checkpoint._chain not in reach.only_used_by([checkpoint.checkpoint_sequential], ["step = ckpt._chain"])
    student = Runner(JudgeConfig())
    try:
        sealed = Sealed(runner, student, [], [], {}, [])
        sealed.check(ones, ones, lambda r: (3,), world_sizes=(1,), trials=1, allow=[checkpoint],
                     forbid={checkpoint.checkpoint_sequential: "write it"})
        with pytest.raises(Tripwire, match=r"through_the_chain called parakit\.checkpoint\._chain, which only "
                                           r"the parts of parakit this exercise forbids use"):
            sealed.check(through_the_chain, ones, lambda r: (3,), world_sizes=(1,), trials=1, allow=[checkpoint],
                         forbid={checkpoint.checkpoint_sequential: "write it"})
    finally:
        student.close()


def answer_code_left(n):
    """The code objects of checkpoint_sequential and _chain that anything in this process still
    reaches (as a constant, a function's code, a frame's)."""
    import gc
    names = {"checkpoint_sequential", "_chain"}
    found = set()
    for obj in gc.get_objects():
        for ref in [obj, *gc.get_referents(obj)]:
            if type(ref).__name__ == "code" and ref.co_name in names and ref.co_filename.endswith("parakit/checkpoint.py"):
                found.add(id(ref))
    return len(found)


def nothing_left(n):
    return 0


def test_in_a_students_rank_the_withheld_answers_code_is_gone_from_memory(runner):
    """Withheld means absent: in the student's rank no object reaches the bytecode of the
    forbidden function or of what only it uses (a rank without the withholding reaches both)."""
    from parakit import checkpoint
    from parakit.grading.judge import Sealed
    assert answer_code_left(0) >= 2  # here, where nothing is withheld: both found
    student = Runner(JudgeConfig())
    try:
        sealed = Sealed(runner, student, [], [], {}, [])
        sealed.check(answer_code_left, nothing_left, lambda r: (0,), world_sizes=(1,), trials=1, allow=[checkpoint],
                     forbid={checkpoint.checkpoint_sequential: "write it"})
    finally:
        student.close()


# ---------------------------------------------------------------------------- the judge's cell limits

def cell(kind: str, source: str, gid: str | None = None, points: int = 0):
    """A code cell of a solution notebook: "setup", "answer" or "test"."""
    import nbformat
    meta = {} if kind == "setup" else {"nbgrader": {"grade_id": gid, "grade": kind == "test", "solution": kind == "answer",
                                                    "locked": kind == "test", "points": points, "schema_version": 3}}
    return nbformat.v4.new_code_cell(source, metadata=meta)


def test_a_cell_gets_ten_times_the_solutions_own_time_at_least_the_floor_so_a_hang_costs_the_floor():
    """The solution's setup statement takes 1 s: the student's gets about ten times that;
    its answer cells take almost no time, so each gets about the floor (3 s here): a hung one
    is cut there, not at the cell timeout (300 s), and a slower one (0.3 s, a tenth of the
    floor) keeps its marks. Nothing here asserts a time shorter than ten times its work."""
    import nbformat
    from parakit.grading.judge import Judge
    solution = nbformat.v4.new_notebook(cells=[
        cell("setup", "import time\nfrom parakit import grading\nTWO = [time.sleep(1.0), 2][1]  # the tests use it"),
        cell("answer", "def double(x):\n    return 2 * x", "double"),
        cell("test", "grading.check_local(double, lambda x: TWO * x, [(3,)], allow=[])", "test_double", 1),
        cell("answer", "def triple(x):\n    return 3 * x", "triple"),
        cell("test", "grading.check_local(triple, lambda x: 3 * x, [(3,)], allow=[])", "test_triple", 1)])
    student = nbformat.from_dict(solution)
    student.cells[1].source = "time.sleep(0.3)  # slower, well inside the floor\ndef double(x):\n    return x + x"
    student.cells[3].source = "time.sleep(10**6)  # never returns"
    judge = Judge(solution, JudgeConfig(cell_floor=3.0))
    try:
        cells, _ = judge._layout({"double": student.cells[1].source, "triple": student.cells[3].source})
        limits = dict(zip([label if student else source for label, source, student in cells], judge.cell_limits(cells)))
        assert limits["TWO = [time.sleep(1.0), 2][1]"] >= 5.0  # ten times 1 s, read to the broker's polling
        assert 3.0 <= limits["<answer triple>"] < 300  # the floor, or ten times the solution's own time
        verdicts, notes = judge.grade(student)
    finally:
        judge.close()
    assert [(v.grade_id, v.points) for v in verdicts] == [("test_double", 1.0), ("test_triple", 0.0)]
    [cut] = [n for n in notes if n.startswith("triple: the answer cell timed out")]
    assert cut.endswith("s); its tests score 0") and 3.0 <= float(cut.split("within ")[1].split(" s)")[0]) < 300
