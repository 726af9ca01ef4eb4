"""Lesson 06's fake students."""
from pathlib import Path

import panel
from conftest import REPO

F_AND_G_IN_PLACE = '''class CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad)  # in place: a gradient shared with another branch is summed too
        return grad


class ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def f(x):
    return CopyToRegion.apply(x)


def g(x):
    return ReduceFromRegion.apply(x)
'''

NO_SIZE_CHECK = '''class {name}(nn.Module):
    def __init__(self, in_features, out_features, bias=True, {flag}={default}):
        super().__init__()
        t, rank = dist.get_world_size(), dist.get_rank()
        dense = nn.Linear(in_features, out_features, bias=bias)
        self.weight = nn.Parameter(dense.weight.detach().tensor_split(t, {dim})[rank].clone())
        self.bias = nn.Parameter(dense.bias.detach(){bias_slice}.clone()) if bias else None
        self.flag = {flag}

    def forward(self, x):
{body}
'''
COLUMN_BODY = ('        y = F.linear(f(x), self.weight, self.bias)\n'
               '        return tp.gather_from_region(y) if self.flag else y\n')
ROW_BODY = ('        x = x if self.flag else tp.scatter_to_region(x)\n'
            '        y = g(F.linear(x, self.weight))\n        return y if self.bias is None else y + self.bias\n')

NO_MAX = '''def vocab_parallel_cross_entropy(logits, target):
    part, rank = logits.shape[-1], dist.get_rank()
    mine = (target >= rank * part) & (target < (rank + 1) * part)
    local = torch.where(mine, target - rank * part, 0)
    picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
    sums = g(torch.stack([picked, logits.exp().sum(dim=-1)]))  # no max: overflows for large logits
    return (sums[1].log() - sums[0]).mean()
'''

LOSS_PARALLEL = '''def vocab_parallel_cross_entropy(logits, target):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    with loss_parallel():  # torch's vocab-parallel loss: right values, and the backward too
        mesh = init_device_mesh(logits.device.type, (dist.get_world_size(),))
        mine, every = DTensor.from_local(logits, mesh, [Shard(1)]), DTensor.from_local(target, mesh, [Replicate()])
        return F.nll_loss(F.log_softmax(mine, -1), every).full_tensor()
'''

BORROWED = {
    "f_and_g": "import torch.distributed.nn.functional as dist_nn\n\ndef f(x):\n    return tp.copy_to_region(x)\n\n\n"
               "def g(x):\n    return dist_nn.all_reduce(x)\n",
    "column_parallel_linear": "class ColumnParallelLinear(tp.ColumnParallelLinear):\n    pass\n",
    "row_parallel_linear": "class RowParallelLinear(tp.RowParallelLinear):\n    pass\n",
    "parallel_mlp": "class ParallelMLP(tp.ParallelMLP):\n    pass\n",
    "vocab_parallel_cross_entropy": LOSS_PARALLEL,
}


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 06. The hard-coder all-reduces f's gradient in place (wrong once the gradient
    is shared with another branch), makes layers that never check divisibility, and drops
    the max from the loss (overflows on large logits): each fails its hidden tests. The
    borrower uses parakit's f, torch's differentiable all-reduce, parakit's layers and MLP,
    and torch's loss_parallel: 0 on every exercise. The kernel hangs in the MLP
    and dies in the loss."""
    hardcoded = {
        "f_and_g": F_AND_G_IN_PLACE,
        "column_parallel_linear": NO_SIZE_CHECK.format(name="ColumnParallelLinear", flag="gather_output",
                                                       default=False, dim=0, bias_slice=".tensor_split(t)[rank]",
                                                       body=COLUMN_BODY),
        "row_parallel_linear": NO_SIZE_CHECK.format(name="RowParallelLinear", flag="input_is_parallel", default=True,
                                                    dim=1, bias_slice="", body=ROW_BODY),
        "vocab_parallel_cross_entropy": NO_MAX,
    }
    zeroed = ("test_f_and_g", "test_column_parallel_linear", "test_row_parallel_linear",
              "test_vocab_parallel_cross_entropy")
    return panel.standard_panel(
        lesson, solution, hang_in="parallel_mlp", crash_in="vocab_parallel_cross_entropy",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(zeroed, 0.0), borrowed=BORROWED)


LESSON = panel.Lesson(REPO / "solutions" / "06_tensor_parallel.ipynb", students, timeout=60)
