"""The "with PyTorch" sections' tools, and every lesson's PyTorch script on 2 and 4 ranks.

Each solution notebook ends with a cell that writes `with_pytorch_NN.py` (%%writefile); the
script's `main()` runs PyTorch's API, checks it against one process and returns the largest
difference. nbval runs each lesson on 2 ranks; here every script runs on each world size it
lists in WORLD_SIZES, and once under torchrun on the smallest, as a student would run it.
"""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.distributed as dist

import parakit
from conftest import REPO, run_script
from parakit import side_by_side, torchrun

SCRIPT_MAGIC = "%%writefile "


def lesson_scripts() -> list[tuple[str, str, str]]:
    """(notebook, script file name, script text) for every %%writefile with_pytorch_* cell."""
    found = []
    for notebook in sorted((REPO / "solutions").glob("*.ipynb")):
        for cell in json.loads(notebook.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and source.startswith(SCRIPT_MAGIC + "with_pytorch_"):
                first, _, body = source.partition("\n")
                found.append((notebook.stem, first.removeprefix(SCRIPT_MAGIC).strip(), body))
    return found


def test_every_lesson_from_01_has_a_pytorch_script():
    lessons = {notebook for notebook, _, _ in lesson_scripts()}
    expected = {p.stem for p in (REPO / "solutions").glob("*.ipynb") if not p.stem.startswith("00")}
    assert expected <= lessons, f"lessons without a with_pytorch_*.py script: {sorted(expected - lessons)}"


@pytest.mark.parametrize("notebook,name,text", lesson_scripts(), ids=[s[1] for s in lesson_scripts()])
def test_lesson_script_matches_one_process(tmp_path, notebook, name, text):
    path = tmp_path / name
    path.write_text(text)
    script = side_by_side.load_script(path)
    assert script.WORLD_SIZES, f"{name} lists no world sizes"
    for world_size in script.WORLD_SIZES:
        differences = parakit.launch(script.main, world_size=world_size)
        assert all(d <= script.TOLERANCE for d in differences), (world_size, differences)
    torchrun.run(path, min(script.WORLD_SIZES))  # unchanged, as a student runs it on a box of their own


# ----------------------------------------------------------------------- the tools themselves

def by_ring(x):
    return parakit.ring_all_reduce(x.clone())


def by_torch(x):
    y = x.clone()
    dist.all_reduce(y)
    return y


def off_by_rank(x):
    return by_torch(x) + (dist.get_rank() == 1)


def test_compare_runs_both_versions_on_the_same_ranks_and_counts_their_calls():
    x = torch.randn(1000)
    both = side_by_side.compare({"ring": by_ring, "torch": by_torch}, x, world_size=2)
    both.check()
    for rank in range(2):
        torch.testing.assert_close(both.runs["torch"][rank].result, x * 2)
        assert both.runs["torch"][rank].collectives == {"allreduce": 1}
        assert both.runs["ring"][rank].collectives == {"send": 2, "recv": 2}  # 2(n-1) steps, one of each
        ring_model = 2 * (2 - 1) * x.nbytes // 2
        assert both.runs["ring"][rank].written >= ring_model   # the OS sees the payload, plus headers
        assert both.runs["torch"][rank].peak >= x.nbytes      # the clone
    table = str(both)
    assert "allreduce x1" in table and "recv x2, send x2" in table


def test_check_names_the_version_and_rank_that_differ():
    both = side_by_side.compare({"torch": by_torch, "off": off_by_rank}, torch.randn(10), world_size=2, memory=False)
    with pytest.raises(AssertionError, match="off differs from torch on rank 1"):
        both.check()


def test_the_counter_names_each_collective_alike_whichever_library_issued_it():
    assert [side_by_side.op_name(n) for n in ("allreduce_", "all_reduce", "_allgather_base_", "all_gather_into_tensor",
                                              "_reduce_scatter_base_", "reduce_scatter_tensor", "recv_", "send")] == \
        ["allreduce", "allreduce", "allgather", "allgather", "reducescatter", "reducescatter", "recv", "send"]


def counted_by_group():
    import torch.distributed._functional_collectives as funcol
    pair = dist.new_group([0, 1])
    with side_by_side.CallCounter() as counter:
        dist.all_reduce(torch.ones(2))
        if dist.get_rank() < 2:
            dist.all_reduce(torch.ones(2), group=pair)  # c10d: the group is an argument
            funcol.all_reduce(torch.ones(2), "sum", pair).wait()  # functional: the group's name is
    return dict(counter.by_group)


def test_the_counter_names_the_group_each_call_ran_on():
    assert parakit.launch(counted_by_group, world_size=4)[0] == {("allreduce", (0, 1, 2, 3)): 1, ("allreduce", (0, 1)): 2}


def ddp_twice():
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(nn.Linear(4, 4))
    with side_by_side.CallCounter() as counter:
        for _ in range(2):  # a module run twice inside one count (CommDebugMode's module tracker fails here)
            model(torch.randn(2, 4)).sum().backward()
    return dict(counter.calls)


def test_the_counter_sees_ddps_all_reduce_issued_from_cpp():
    assert parakit.launch(ddp_twice, world_size=2)[0]["allreduce"] == 2  # one bucket per backward


def metered_on_own_device(nbytes):
    """Measure a function on this rank, its device taken to be logical device `rank` (as each
    rank's own GPU under NCCL): which devices the meter covers, and the peak it reports."""
    from unittest import mock
    from parakit import devices
    rank = dist.get_rank()

    def allocate():
        covered = devices.current_meter().devices
        return covered, torch.ones(nbytes // 4).sum()

    with mock.patch.object(devices, "device", lambda: torch.device("cpu", rank)):
        measured = side_by_side.measure(allocate)
    return measured.result[0], measured.peak


FIRST_MEASURE = """
import json, sys, parakit, torch
from parakit import side_by_side

def first_call_finds_dynamo_imported():
    return side_by_side.measure(lambda: "torch._dynamo" in sys.modules and torch.ones(2) + 1 is not None).result

if __name__ == "__main__":
    print(json.dumps(parakit.launch(first_call_finds_dynamo_imported, world_size=2)))
"""


def test_a_processs_first_measured_call_does_not_pay_for_importing_torch_dynamo(tmp_path):
    """A dispatch mode's first operator imports torch._dynamo (about 1 s in a fresh rank):
    measure imports it before its clock starts (a fresh interpreter: no rank has it yet)."""
    done = run_script(tmp_path, FIRST_MEASURE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [True, True]


def test_measure_meters_each_ranks_own_device_only():
    for rank, (covered, peak) in enumerate(parakit.launch(metered_on_own_device, 4096, world_size=4)):
        assert covered == [torch.device("cpu", rank)], (rank, covered)   # not every device, not device 0
        assert peak >= 4096


def unseen_by_the_os(x):
    """measure, as under NCCL, where the OS counts none of the rank's bytes (here: no /proc/self/io):
    an all-reduce, the ring's sends, and torch's DDP reducing one bucket from C++."""
    from unittest import mock
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from parakit import comm
    model = DistributedDataParallel(nn.Linear(4, 4))  # 20 parameters: one bucket of 80 bytes
    with mock.patch.object(comm, "_PROC_IO", "/nonexistent/io"):
        runs = [side_by_side.measure(by_torch, x), side_by_side.measure(by_ring, x),
                side_by_side.measure(lambda: model(torch.ones(2, 4)).sum().backward(), memory=False)]
    return runs, str(side_by_side.Comparison({"torch": runs[:1]}))


@pytest.mark.parametrize("world_size", [2, 4])
def test_where_the_os_counts_no_bytes_written_is_the_ring_models_and_says_so(world_size):
    n, x = world_size, torch.randn(1000)
    for runs, table in parakit.launch(unseen_by_the_os, x, world_size=n):
        ring = 2 * (n - 1) * x.nbytes // n
        assert [m.written for m in runs] == [ring, ring, 2 * (n - 1) * 80 // n]
        assert [m.written_by for m in runs] == ["model"] * 3
        assert f"{ring:,} (model)" in table


EMULATED_MEASURE = """
import json, os, parakit, torch, torch.distributed as dist
from parakit import devices, side_by_side

def doubled(x):
    covered = [str(d) for d in devices.current_meter().devices]
    y = x * 2
    dist.all_reduce(y)
    return covered, str(y.device)

def measured(x):
    m = side_by_side.measure(doubled, x)
    return m.result, m.peak, m.written, getattr(m, "written_by", None)

print(json.dumps(parakit.launch(measured, torch.ones(1000), world_size=4)))
"""


def test_on_the_emulated_gpu_box_measure_meters_each_ranks_own_gpu_and_writes_the_model(tmp_path):
    """4 fgpu ranks on the emulated NCCL: each rank's meter is its own GPU's alone, and the bytes
    written, which the OS cannot count there, are the ring model's for the all-reduce it counted
    (the emulated group's operations pass the dispatcher as NCCL's do): 2 (n - 1) / n of 4,000 B."""
    done = run_script(tmp_path, "import os\nos.environ['PARAKIT_EMULATE_GPUS'] = '4'\n" + EMULATED_MEASURE)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank, ((covered, where), peak, written, by) in enumerate(json.loads(done.stdout.splitlines()[-1])):
        assert covered == [f"fgpu:{rank}"] and where == f"fgpu:{rank}", (rank, covered, where)
        assert peak >= 4000
        assert by == "model" and written == 2 * 3 * 4000 // 4


def test_compare_needs_two_versions():
    with pytest.raises(ValueError, match="at least two versions"):
        side_by_side.compare({"torch": by_torch}, torch.randn(3), world_size=2)


def test_a_loaded_script_runs_its_current_text_on_the_ranks(tmp_path):
    path = tmp_path / "with_pytorch_probe.py"
    for value in (1, 2):  # the same pool both times: ranks must not keep the first module
        path.write_text(f"VALUE = {value}\n\ndef answer():\n    return VALUE\n\nif __name__ == '__main__':\n    raise SystemExit\n")
        assert parakit.launch(side_by_side.load_script(path).answer, world_size=2) == [value, value]


def test_load_script_says_which_cell_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="run the %%writefile cell"):
        side_by_side.load_script(tmp_path / "missing.py")


def test_available_prints_one_line_for_what_cannot_run(capsys):
    needed = torch.cuda.device_count() + 1
    assert side_by_side.available("context_parallel", gpus=needed) is False
    gpus = "GPU" if needed == 1 else "GPUs"
    assert capsys.readouterr().out == f"skipped: context_parallel needs {needed} CUDA {gpus}, this machine has {needed - 1}\n"
    assert side_by_side.available("DistributedDataParallel") is True


def test_torchrun_runs_a_script_on_two_processes(tmp_path, capsys):
    script = tmp_path / "hello.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from parakit.torchrun import process_group
        with process_group():
            x = torch.tensor([dist.get_rank() + 1.0])
            dist.all_reduce(x)
            print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {dist.get_backend()}: sum {x.item():.0f}")
    """))
    output = torchrun.run(script, 2)
    assert "rank 0 of 2 on gloo: sum 3" in output and "rank 1 of 2 on gloo: sum 3" in output
    assert capsys.readouterr().out.startswith("$ torchrun --standalone --nproc-per-node=2 ")


def test_torchrun_failure_raises_with_its_output(tmp_path, capsys):
    script = tmp_path / "broken.py"
    script.write_text("raise ValueError('the script failed here')\n")
    with pytest.raises(RuntimeError, match="torchrun exited with"):
        torchrun.run(script, 2)
    assert "the script failed here" in capsys.readouterr().out
