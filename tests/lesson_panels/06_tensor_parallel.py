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

# Wrong techniques with the right values: each must score 0 on its exercise (its calls, one by one, are not parakit's).
G_BOTH_WAYS = F_AND_G_IN_PLACE.replace(
    "dist.all_reduce(grad)  # in place: a gradient shared with another branch is summed too\n        return grad",
    "grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad").replace(
    "    def backward(ctx, grad):\n        return grad\n",
    "    def backward(ctx, grad):\n        grad = grad.clone()\n        dist.all_reduce(grad)  # g all-reduces the gradient too\n"
    "        return grad\n")

F_GATHERS_GRADIENTS = F_AND_G_IN_PLACE.replace(
    "dist.all_reduce(grad)  # in place: a gradient shared with another branch is summed too\n        return grad",
    "every = [torch.empty_like(grad) for _ in range(dist.get_world_size())]\n"
    "        dist.all_gather(every, grad.contiguous())  # every rank's gradient, summed here: not an all-reduce\n"
    "        return torch.stack(every).sum(0)")

COLUMN_ALWAYS_GATHERS = '''class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, gather_output=False):
        super().__init__()
        t, rank = dist.get_world_size(), dist.get_rank()
        if out_features % t:
            raise ValueError(f"out_features={out_features} is not divisible by the tensor-parallel size {t}")
        dense = nn.Linear(in_features, out_features, bias=bias)
        self.weight = nn.Parameter(dense.weight.detach().chunk(t, 0)[rank].clone())
        self.bias = nn.Parameter(dense.bias.detach().chunk(t, 0)[rank].clone()) if bias else None
        self.gather_output = gather_output

    def forward(self, x):
        y = tp.gather_from_region(F.linear(f(x), self.weight, self.bias))   # gathered whatever gather_output says
        return y if self.gather_output else y.chunk(dist.get_world_size(), -1)[dist.get_rank()]
'''

MLP_GATHERED = '''class ParallelMLP(nn.Module):
    def __init__(self, hidden, ffn_hidden):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, gather_output=True)       # all-gathers [..., ffn]
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, input_is_parallel=False)     # and slices it again

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))
'''

LOSS_PADDED_ALL_REDUCE = '''def vocab_parallel_cross_entropy(logits, target):
    t, rank, part = dist.get_world_size(), dist.get_rank(), logits.shape[-1]
    top = logits.detach().amax(dim=-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    full = torch.zeros(logits.shape[0], part * t, dtype=logits.dtype, device=logits.device)
    full[:, rank * part:(rank + 1) * part] = logits - top.unsqueeze(-1)
    full = g(full)                       # every logit on every rank: an all-gather written as an all-reduce
    return (full.exp().sum(-1).log() - full.gather(-1, target.unsqueeze(-1)).squeeze(-1)).mean()
'''

# Right, written another way: each keeps full marks.
F_AND_G_ASYNC = '''class CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        total = grad.detach().clone()
        dist.all_reduce(total, async_op=True).wait()
        return total


class ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        total = x.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, async_op=True).wait()
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


def f(x):
    return CopyToRegion.apply(x)


def g(x):
    return ReduceFromRegion.apply(x)
'''

LOSS_FUNCTION = '''class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        part, rank = logits.shape[-1], dist.get_rank()
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        shifted = logits - top[:, None]
        owned = (target >= rank * part) & (target < (rank + 1) * part)
        index = (target - rank * part).clamp(0, part - 1)
        sums = torch.stack([shifted.exp().sum(-1), shifted.gather(1, index[:, None])[:, 0] * owned])
        dist.all_reduce(sums)                       # sum of exponentials and target logit, in the other order
        ctx.save_for_backward(shifted.exp() / sums[0][:, None], index, owned)
        return (sums[0].log() - sums[1]).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, index, owned = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits[torch.arange(len(index), device=index.device), index] -= owned.to(softmax.dtype)
        return grad_logits * grad / len(index), None


def vocab_parallel_cross_entropy(logits, target):
    return _VocabParallelCrossEntropy.apply(logits, target)
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
    the max from the loss (overflows on large logits; one hidden case has every logit near 200,
    since 300 x randn can draw a few that all stay below 88.7): each fails its hidden tests. The
    borrower uses parakit's f, torch's differentiable all-reduce, parakit's layers and MLP,
    and torch's loss_parallel: 0 on every exercise. The kernel hangs in the MLP
    and dies in the loss. Wrong techniques with right values, 0 on their exercise and on those
    built on it: a g that all-reduces backward too, an f whose backward all-gathers and sums, a
    column layer that gathers when gather_output=False, an MLP that gathers fc1's output, a loss
    that all-reduces zero-padded full logits (an all-gather written as an all-reduce). Right
    ones written another way keep full marks: f and g with async_op waited, the loss as an
    autograd Function with its sums stacked in the other order."""
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
    full, pts = panel.full_solution(panel.load(lesson), panel.load(solution)), panel.points(panel.load(lesson))

    def student(name, sources, zero=()):
        return panel.Student(name, {Path(lesson).name: panel.with_sources(full, sources)},
                             {t: 0.0 if t in zero else p for t, p in pts.items()})

    extra = [
        student("g_both_ways", {"f_and_g": G_BOTH_WAYS},   # and every layer built on g: row, MLP, the loss
                ("test_f_and_g", "test_row_parallel_linear", "test_parallel_mlp", "test_vocab_parallel_cross_entropy")),
        student("f_gathers_gradients", {"f_and_g": F_GATHERS_GRADIENTS},   # and column, MLP, built on f
                ("test_f_and_g", "test_column_parallel_linear", "test_parallel_mlp")),
        student("column_always_gathers", {"column_parallel_linear": COLUMN_ALWAYS_GATHERS},
                ("test_column_parallel_linear", "test_parallel_mlp")),
        student("mlp_gathered", {"parallel_mlp": MLP_GATHERED}, ("test_parallel_mlp",)),
        student("loss_padded_all_reduce", {"vocab_parallel_cross_entropy": LOSS_PADDED_ALL_REDUCE},
                ("test_vocab_parallel_cross_entropy",)),
        student("f_and_g_async", {"f_and_g": F_AND_G_ASYNC}),
        student("loss_function", {"vocab_parallel_cross_entropy": LOSS_FUNCTION}),
    ]
    return panel.standard_panel(
        lesson, solution, hang_in="parallel_mlp", crash_in="vocab_parallel_cross_entropy",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(zeroed, 0.0), borrowed=BORROWED, extra=extra)


LESSON = panel.Lesson(REPO / "solutions" / "06_tensor_parallel.ipynb", students, timeout=60)
