"""Lesson 03's fake students."""
from pathlib import Path

import panel
from conftest import REPO


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 03. The hard-coder guesses the owners instead of reading them: parameter i to
    rank i % N in the ZeRO-1 step, layer by layer in the ZeRO-2 backward (right only for the
    equal sizes of the visible tests), and needs no padding in the sharded linear (each 0 on
    the hidden tests); the borrower all-reduces in the ZeRO-1 step, builds parakit's ShardedOptimizer in
    the ZeRO-2 backward and wraps the layer in parakit's FSDP (each 0 by the tripwires); the
    kernel hangs in the ZeRO-2 backward and dies in the sharded linear. `keeps_full_weight`
    saves the gathered buffer for backward (and gathers again there, so that values and
    all-gather counts are right): 0 on the sharded linear, for the bytes its forward leaves alive.
    In the loss-scaling step the hard-coder decides on its own gradients alone (0: another rank's
    overflow must skip its step too); the borrower steps through parakit's LossScaler."""
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
    return panel.standard_panel(
        lesson, solution, hang_in="zero2_backward", crash_in="sharded_linear",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=borrowed,
        extra=[panel.Student("keeps_full_weight", {name: panel.with_sources(full, keeps_full_weight)},
                             {**pts, "test_sharded_linear": 0.0})])


LESSON = panel.Lesson(REPO / "solutions" / "03_zero.ipynb", students, timeout=45)
