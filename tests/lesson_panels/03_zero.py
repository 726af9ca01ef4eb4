"""Lesson 03's fake students."""
from pathlib import Path

import panel
from conftest import REPO


GATHERS_GRADIENTS = """def zero1_step(params, owners, optimizer):
    n = dist.get_world_size()
    if not hasattr(optimizer, "everything"):   # one optimizer over every parameter, kept between steps
        optimizer.everything = type(optimizer)(params)
        optimizer.everything.param_groups[0].update(optimizer.defaults)
    with torch.no_grad():
        for p in params:   # every rank gets every gradient, and averages them itself
            every = torch.empty(n * p.numel(), device=p.device)
            dist.all_gather_single(every, p.grad.reshape(-1))
            p.grad = every.view(n, *p.shape).mean(0)
        optimizer.everything.step()
    return params
"""

FULL_OPTIMIZER_STATE = """def zero1_step(params, owners, optimizer):
    n = dist.get_world_size()
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    others = [p for p in params if id(p) not in mine]
    if others:   # every rank steps every parameter
        optimizer.add_param_group({"params": others})
    with torch.no_grad():
        for p, owner in zip(params, owners):   # an all-reduce, as reduce + broadcast
            p.grad.div_(n)
            dist.reduce(p.grad, owner)
        for p, owner in zip(params, owners):
            dist.broadcast(p.grad, owner)
        optimizer.step()
    return params
"""

SUMS_ON_OWNER = """def zero1_step(params, owners, optimizer):
    n, rank = dist.get_world_size(), dist.get_rank()
    with torch.no_grad():
        for p, owner in zip(params, owners):
            dist.reduce(p.grad, dst=owner)
            if owner == rank:
                p.grad /= n
            else:
                p.grad = None   # not mine: I never need it
        optimizer.step()
        for p, owner in zip(params, owners):
            dist.broadcast(p.data, src=owner)
    return params
"""

REDUCES_AFTER_BACKWARD = """def zero2_backward(model, x, y, owners):
    n, rank = dist.get_world_size(), dist.get_rank()
    F.mse_loss(model(x), y).backward()
    params = list(model.parameters())
    for p, owner in reversed(list(zip(params, owners))):   # backward's order, but after it
        p.grad.div_(n)
        dist.reduce(p.grad, owner)
        if owner != rank:
            p.grad = None
    return [p.grad for p in params]
"""

KEEPS_FULL_GRADIENTS = """def zero2_backward(model, x, y, owners):
    n, rank = dist.get_world_size(), dist.get_rank()

    def reduce_to_owner(p, owner):
        p.grad.div_(n)
        dist.reduce(p.grad, owner)

    params = list(model.parameters())
    hooks = [p.register_post_accumulate_grad_hook(lambda p, owner=owner: reduce_to_owner(p, owner))
             for p, owner in zip(params, owners)]
    F.mse_loss(model(x), y).backward()
    for hook in hooks:
        hook.remove()
    for p, owner in zip(params, owners):   # dropped only now: every gradient was held until the end
        if owner != rank:
            p.grad = None
    return [p.grad for p in params]
"""

ZERO2_SUMS_ON_OWNER = """def zero2_backward(model, x, y, owners):
    n, rank = dist.get_world_size(), dist.get_rank()
    params = list(model.parameters())

    def hook(p):
        owner = owners[next(i for i, q in enumerate(params) if q is p)]
        dist.reduce(p.grad, dst=owner)
        if owner == rank:
            p.grad.mul_(1.0 / n)
        else:
            p.grad = None

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    try:
        F.mse_loss(model(x), y).backward()
    finally:
        for h in handles:
            h.remove()
    return [p.grad for p in params]
"""

NO_REGATHER = """def sharded_linear(shard, x, out_features, in_features):
    return Gathered.apply(shard, x, out_features, in_features)

class Gathered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, x, o, i):
        full = torch.empty(dist.get_world_size() * shard.numel())
        dist.all_gather_single(full, shard.detach())
        weight = full[:o * i].view(o, i)
        ctx.save_for_backward(x, weight)   # the gathered weight, kept until backward: no second gather
        ctx.sizes = o, i, shard.numel()
        return x @ weight.T + full[o * i:o * (i + 1)]

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        o, i, c = ctx.sizes
        n = dist.get_world_size()
        flat = torch.zeros(n * c)
        flat[:o * (i + 1)] = torch.cat([(gy.T @ x).reshape(-1), gy.sum(0)])
        g = torch.empty(c)
        dist.reduce_scatter_single(g, flat)
        return g / n, gy @ weight, None, None
"""

LIST_COLLECTIVES = """def sharded_linear(shard, x, out_features, in_features):
    return ListLinear.apply(shard, x, out_features, in_features)

def gather_full(shard):
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, shard.detach().contiguous())
    return torch.cat(pieces)

class ListLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, x, o, i):
        full = gather_full(shard)
        ctx.save_for_backward(shard, x)
        ctx.o, ctx.i = o, i
        return torch.addmm(full[o * i:o * (i + 1)], x, full[:o * i].view(o, i).T)

    @staticmethod
    def backward(ctx, gy):
        shard, x = ctx.saved_tensors
        o, i, n = ctx.o, ctx.i, dist.get_world_size()
        grads = torch.cat([(gy.T @ x).flatten(), gy.sum(0)])
        flat = F.pad(grads, (0, n * shard.numel() - grads.numel()))   # the padding, at the end
        mine = torch.empty_like(shard)
        dist.reduce_scatter(mine, list(flat.chunk(n)))   # the gradient first, then the weight again
        weight = gather_full(shard)[:o * i].view(o, i)
        return mine / n, gy @ weight, None, None
"""


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 03. The hard-coder guesses the owners instead of reading them: parameter i to
    rank i % N in the ZeRO-1 step, layer by layer in the ZeRO-2 backward (right only for the
    equal sizes of the visible tests, and for some random sizes: the hidden tests also have
    fixed sizes where neither guess is the owners), and needs no padding in the sharded linear
    (each 0 on the hidden tests); the borrower all-reduces in the ZeRO-1 step, builds parakit's ShardedOptimizer in
    the ZeRO-2 backward and wraps the layer in parakit's FSDP (each 0 by the tripwires); the
    kernel hangs in the ZeRO-2 backward and dies in the sharded linear.

    Two students with wrong techniques and right values, each 0 on the three exercises (answers
    put together, to keep the panel's executed notebooks few). `wrong_techniques`: all-gathers every gradient and steps a
    full optimizer of its own (its calls differ); reduces each gradient, in backward's order, once
    backward is done (late); saves the gathered weight for backward instead of gathering again (one
    all-gather fewer). `keeps_too_much`: builds an all-reduce from reduce + broadcast of the
    gradients and adds every parameter to its optimizer (ZeRO-1's very calls, but every parameter's
    optimizer state kept); reduces from the hooks but drops the others' gradients only after
    backward (its peak); saves the gathered buffer for backward (and gathers again there, so that
    values and calls are right: the bytes its forward leaves alive). In the loss-scaling step the
    hard-coder decides on its own gradients alone (0: another rank's overflow must skip its step
    too); the borrower steps through parakit's LossScaler. `another_way`, full marks: divides on
    the owner after the reduces and drops the gradients it does not own (ZeRO-1 and ZeRO-2); gathers
    and reduce-scatters with the list APIs, pads with F.pad and reduce-scatters before gathering
    again in backward."""
    full = panel.full_solution(panel.load(lesson), panel.load(solution))
    name, pts = lesson.name, panel.points(panel.load(lesson))
    hardcoded = {
        "zero1_step": "def zero1_step(params, owners, optimizer):\n    n = dist.get_world_size()\n"
                      "    with torch.no_grad():\n        for i, p in enumerate(params):\n"
                      "            p.grad.div_(n)\n            dist.reduce(p.grad, i % n)\n        optimizer.step()\n"
                      "        for i, p in enumerate(params):\n            dist.broadcast(p, i % n)\n    return params\n",
        "zero2_backward": "def zero2_backward(model, x, y, owners):\n    n, rank = dist.get_world_size(), dist.get_rank()\n"
                          "    def hook(p, i):\n        p.grad.div_(n)\n        dist.reduce(p.grad, i // 2 % n)\n"
                          "        if i // 2 % n != rank:\n            p.grad = None\n"
                          "    hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: hook(p, i))\n"
                          "             for i, p in enumerate(model.parameters())]\n"
                          "    F.mse_loss(model(x), y).backward()\n    for h in hooks:\n        h.remove()\n"
                          "    return [p.grad for p in model.parameters()]\n",
        "sharded_linear": "def sharded_linear(shard, x, out_features, in_features):\n    return Unpadded.apply(shard, x, out_features, in_features)\n\n"
                          "class Unpadded(torch.autograd.Function):\n    @staticmethod\n"
                          "    def forward(ctx, shard, x, o, i):\n        ctx.save_for_backward(shard, x)\n        ctx.sizes = o, i\n"
                          "        full = torch.empty(o * (i + 1))\n        dist.all_gather_single(full, shard.detach())\n"
                          "        return x @ full[:o * i].view(o, i).T + full[o * i:]\n\n    @staticmethod\n"
                          "    def backward(ctx, gy):\n        shard, x = ctx.saved_tensors\n        o, i = ctx.sizes\n"
                          "        full = torch.empty(o * (i + 1))\n        dist.all_gather_single(full, shard.detach())\n"
                          "        flat = torch.cat([(gy.T @ x).reshape(-1), gy.sum(0)])\n        g = torch.empty_like(shard)\n"
                          "        dist.reduce_scatter_single(g, flat)\n"
                          "        return g / dist.get_world_size(), gy @ full[:o * i].view(o, i), None, None\n",
        "loss_scaled_step": "def loss_scaled_step(loss, optimizer, scale, clean_steps, growth_interval):\n"
                            "    (loss * scale).backward()\n"
                            "    grads = [p.grad for g in optimizer.param_groups for p in g['params']]\n"
                            "    if any(not g.isfinite().all() for g in grads):  # its own gradients only\n"
                            "        return False, scale * 0.5, 0\n"
                            "    for g in grads:\n        g.div_(scale)\n    optimizer.step()\n"
                            "    clean_steps += 1\n"
                            "    return (True, scale * 2.0, 0) if clean_steps == growth_interval else (True, scale, clean_steps)\n",
    }
    borrowed = {
        "zero1_step": "def zero1_step(params, owners, optimizer):\n    for p in params:\n        dist.all_reduce(p.grad)\n"
                      "        p.grad.div_(dist.get_world_size())\n    optimizer.step()\n    for p, o in zip(params, owners):\n"
                      "        dist.broadcast(p.data, o)\n    return params\n",
        "zero2_backward": "def zero2_backward(model, x, y, owners):\n"
                          "    zero.ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.0)\n"
                          "    F.mse_loss(model(x), y).backward()\n    return [p.grad for p in model.parameters()]\n",
        "sharded_linear": "def sharded_linear(shard, x, out_features, in_features):\n"
                          "    layer = zero.FullyShardedDataParallel(nn.Linear(in_features, out_features))\n"
                          "    return layer(x)\n",
        "loss_scaled_step": "def loss_scaled_step(loss, optimizer, scale, clean_steps, growth_interval):\n"
                            "    scaler = precision.LossScaler(init_scale=scale, growth_interval=growth_interval,\n"
                            "                                  group=dist.group.WORLD)\n"
                            "    scaler.clean_steps = clean_steps\n    scaler.scale(loss).backward()\n"
                            "    stepped = not scaler.unscale_(optimizer)\n    scaler.step(optimizer)\n    scaler.update()\n"
                            "    return stepped, scaler.get_scale(), scaler.clean_steps\n",
    }
    keeps_full_weight = {
        "sharded_linear": "def sharded_linear(shard, x, out_features, in_features):\n"
                          "    return KeepsWeight.apply(shard, x, out_features, in_features)\n\n"
                          "def gather(shard):\n    full = torch.empty(dist.get_world_size() * shard.numel())\n"
                          "    dist.all_gather_single(full, shard.detach())\n    return full\n\n"
                          "class KeepsWeight(torch.autograd.Function):\n    @staticmethod\n"
                          "    def forward(ctx, shard, x, o, i):\n        full = gather(shard)\n"
                          "        ctx.save_for_backward(shard, x, full)  # the full parameters, kept until backward\n"
                          "        ctx.sizes = o, i\n        return x @ full[:o * i].view(o, i).T + full[o * i:o * (i + 1)]\n\n"
                          "    @staticmethod\n    def backward(ctx, gy):\n        shard, x, _ = ctx.saved_tensors\n"
                          "        o, i = ctx.sizes\n        full = gather(shard)\n        flat = torch.zeros_like(full)\n"
                          "        flat[:o * (i + 1)] = torch.cat([(gy.T @ x).reshape(-1), gy.sum(0)])\n"
                          "        g = torch.empty_like(shard)\n        dist.reduce_scatter_single(g, flat)\n"
                          "        return g / dist.get_world_size(), gy @ full[:o * i].view(o, i), None, None\n",
    }

    def student(who, sources, zeroed=()):
        return panel.Student(who, {name: panel.with_sources(full, sources)}, {**pts, **dict.fromkeys(zeroed, 0.0)})

    return panel.standard_panel(
        lesson, solution, hang_in="zero2_backward", crash_in="sharded_linear",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=borrowed,
        extra=[student("wrong_techniques", {"zero1_step": GATHERS_GRADIENTS, "zero2_backward": REDUCES_AFTER_BACKWARD,
                                            "sharded_linear": NO_REGATHER},
                       ["test_zero1_step", "test_zero2_backward", "test_sharded_linear"]),
               student("keeps_too_much", {"zero1_step": FULL_OPTIMIZER_STATE, "zero2_backward": KEEPS_FULL_GRADIENTS,
                                          "sharded_linear": keeps_full_weight["sharded_linear"]},
                       ["test_zero1_step", "test_zero2_backward", "test_sharded_linear"]),
               student("another_way", {"zero1_step": SUMS_ON_OWNER, "zero2_backward": ZERO2_SUMS_ON_OWNER,
                                       "sharded_linear": LIST_COLLECTIVES})])


LESSON = panel.Lesson(REPO / "solutions" / "03_zero.ipynb", students, timeout=45)
