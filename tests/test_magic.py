"""The %%ranks cell magic, driven through a real IPython shell and real worker processes."""
import pytest
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython

import parakit


@pytest.fixture(scope="module")
def ip():
    shell = start_ipython()
    shell.run_line_magic("load_ext", "parakit")
    return shell


def test_ranks_cell_runs_on_every_rank_and_prints_last_expression(ip, capsys):
    ip.run_cell_magic("ranks", "2", "import torch, torch.distributed as dist\n"
                                    "x = torch.ones(2) * (dist.get_rank() + 1)\n"
                                    "dist.all_reduce(x)\nx")
    out = capsys.readouterr().out
    assert "[rank 0] tensor([3., 3.])" in out
    assert "[rank 1] tensor([3., 3.])" in out


def test_ranks_keep_their_namespace_between_cells(ip, capsys):
    ip.run_cell_magic("ranks", "2", "import torch.distributed as dist\nmine = 100 + dist.get_rank()")
    ip.run_cell_magic("ranks", "2", "mine * 2")
    out = capsys.readouterr().out
    assert "[rank 0] 200" in out and "[rank 1] 202" in out


def test_a_group_made_in_one_cell_serves_the_next(ip, capsys):
    """A %%ranks cell's process groups live on with its names (a launched call's are destroyed)."""
    ip.run_cell_magic("ranks", "2", "import torch, torch.distributed as dist\npair = dist.new_group([0, 1])")
    ip.run_cell_magic("ranks", "2", "x = torch.ones(1)\ndist.all_reduce(x, group=pair)\nx.item()")
    out = capsys.readouterr().out
    assert "[rank 0] 2.0" in out and "[rank 1] 2.0" in out


def test_ranks_error_shows_cell_line_and_keeps_namespace(ip, capsys):
    ip.run_cell_magic("ranks", "2", "import torch.distributed as dist\nkept = 7")
    with pytest.raises(parakit.RankError) as error:
        ip.run_cell_magic("ranks", "2", "if dist.get_rank() == 1:\n    raise KeyError('no such key')")
    assert "rank 1 failed" in str(error.value)
    assert "raise KeyError('no such key')" in str(error.value)  # the cell's source line is shown
    ip.run_cell_magic("ranks", "2", "kept")  # no collective was pending: the same processes go on
    assert "[rank 0] 7" in capsys.readouterr().out


def test_ranks_hang_is_reported_and_next_cell_says_names_are_gone(ip, capsys):
    ip.run_cell_magic("ranks", "2", "import torch, torch.distributed as dist\nbefore = 1")
    with pytest.raises(parakit.CollectiveHang, match="waits in all_reduce #1"):
        ip.run_cell_magic("ranks", "2 --timeout 20",
                          "x = torch.ones(1)\nif dist.get_rank() == 0:\n    dist.all_reduce(x)")
    capsys.readouterr()
    with pytest.raises(parakit.RankError, match="name 'before' is not defined"):
        ip.run_cell_magic("ranks", "2", "before")
    assert "names defined by earlier %%ranks cells are gone" in capsys.readouterr().out


@pytest.mark.parametrize("line", ["", "two", "2 --backend", "2 --timeout soon"])
def test_ranks_bad_arguments_get_usage_error(ip, line):
    with pytest.raises(UsageError, match="Usage: %%ranks N"):
        ip.run_cell_magic("ranks", line, "pass")


def test_ranks_bad_backend_is_refused(ip):
    # "no NCCL" on a CPU build of torch, "one GPU per rank" on a CUDA build without 2 GPUs
    with pytest.raises(ValueError, match="backend 'nccl'.*use backend='gloo'"):
        ip.run_cell_magic("ranks", "2 --backend nccl", "pass")


def test_ranks_death_is_reported_with_how_it_died_and_the_next_cell_runs(ip, capsys):
    with pytest.raises(parakit.RankDied, match="rank 1 died: exited with code 5"):
        ip.run_cell_magic("ranks", "2", "import os, torch.distributed as dist\n"
                                        "if dist.get_rank() == 1:\n    os._exit(5)")
    ip.run_cell_magic("ranks", "2", "import torch.distributed as dist\ndist.get_world_size()")
    assert "[rank 1] 2" in capsys.readouterr().out
