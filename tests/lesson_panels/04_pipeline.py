"""Lesson 04's fake students."""
from pathlib import Path

import panel
from conftest import REPO

GPIPE_MSE_ONLY = '''def gpipe_step(model, x, target, loss_fn, m):
    """GPipe on stage model[rank]: m forwards, then m backwards, with send/recv between neighbours."""
    rank, p = dist.get_rank(), dist.get_world_size()
    stage = model[rank]
    inputs, outputs = [], []
    for x_i, target_i in zip(x.chunk(m), target.chunk(m)):   # forwards: [batch/m, hidden] each
        inp = x_i
        if rank > 0:
            inp = torch.empty_like(x_i)
            dist.recv(inp, rank - 1)
            inp.requires_grad_()
        out = stage(inp)
        if rank < p - 1:
            dist.send(out.detach(), rank + 1)
        else:
            out = F.mse_loss(out, target_i) / m
        inputs.append(inp)
        outputs.append(out)
    for inp, out in zip(inputs, outputs):                     # backwards
        if rank < p - 1:
            grad = torch.empty_like(out)
            dist.recv(grad, rank + 1)
            out.backward(grad)
        else:
            out.backward()
        if rank > 0:
            dist.send(inp.grad, rank - 1)
    return [q.grad for q in stage.parameters()]
'''  # right, but the loss is always the squared error: the hidden tests use another


PLACE_W_UP_TO_RANK_3 = '''def place_weight_passes(order, p, rank):
    lag = {0: 0, 1: 1, 2: 2, 3: 3}[rank]   # the visible tests have at most 4 ranks
    out, backwards = [], []
    for op, i in order:
        out.append((op, i))
        if op == "B":
            backwards.append(i)
            if len(backwards) > lag:
                out.append(("W", backwards[-1 - lag]))
    return out + [("W", i) for i in backwards[len(backwards) - lag:]]
'''  # right up to 4 ranks; the hidden tests go to 8


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 04. The hard-coder's 1F1B order knows only p = 2 and 4, its stage ignores
    loss_fn (always the squared error), so does its GPipe step, its bubble is a table of the visible cases and its W
    placement knows only ranks 0-3 (each 0 on the hidden tests); the borrower calls parakit's 1F1B builder, parakit's
    pipeline_step (in the stage and in GPipe), parakit's bubble formula and parakit's W placement (each 0 by the
    tripwires); the kernel hangs
    in the bubble formula and dies in the stage."""
    pts = panel.points(panel.load(lesson))
    hardcoded = {
        "one_f_one_b_order": "def one_f_one_b_order(p, m, rank):\n    warmup = {2: 1, 4: 3}[p] - rank\n"
                             "    order = [('F', i) for i in range(warmup)]\n    for i in range(m - warmup):\n"
                             "        order += [('F', warmup + i), ('B', i)]\n"
                             "    return order + [('B', i) for i in range(m - warmup, m)]\n",
        "stage_step": "def stage_step(model, x, target, loss_fn):\n    rank, p = dist.get_rank(), dist.get_world_size()\n"
                      "    stage, inp = model[rank], x\n    if rank > 0:\n        inp = torch.empty_like(x)\n"
                      "        dist.recv(inp, rank - 1)\n        inp.requires_grad_()\n    out = stage(inp)\n"
                      "    if rank < p - 1:\n        dist.send(out.detach(), rank + 1)\n        grad = torch.empty_like(out)\n"
                      "        dist.recv(grad, rank + 1)\n        out.backward(grad)\n    else:\n"
                      "        F.mse_loss(out, target).backward()\n    if rank > 0:\n        dist.send(inp.grad, rank - 1)\n"
                      "    return [q.grad for q in stage.parameters()]\n",
        "bubble_fraction": "def bubble_fraction(p, m, v=1):\n"
                           "    return {(2, 8, 1): 1 / 9, (4, 4, 1): 3 / 7, (4, 8, 2): 3 / 19}[(p, m, v)]\n",
        "gpipe_step": GPIPE_MSE_ONLY,
        "place_weight_passes": PLACE_W_UP_TO_RANK_3,
    }
    borrowed = {
        "one_f_one_b_order": "def one_f_one_b_order(p, m, rank):\n"
                             "    return [(a.op, a.microbatch) for a in pipeline.one_f_one_b(p, m).compute(rank)]\n",
        "stage_step": "def stage_step(model, x, target, loss_fn):\n    p = dist.get_world_size()\n"
                      "    pipeline.pipeline_step(model, [1] * p, x, target, loss_fn, schedule='gpipe', num_microbatches=1)\n"
                      "    return [q.grad for q in model[dist.get_rank()].parameters()]\n",
        "bubble_fraction": "def bubble_fraction(p, m, v=1):\n    return float(pipeline.bubble_formula(p, m, v))\n",
        "gpipe_step": "def gpipe_step(model, x, target, loss_fn, m):\n    p = dist.get_world_size()\n"
                      "    pipeline.pipeline_step(model, [1] * p, x, target, loss_fn, schedule='gpipe', num_microbatches=m)\n"
                      "    return [q.grad for q in model[dist.get_rank()].parameters()]\n",
        "place_weight_passes": "def place_weight_passes(order, p, rank):\n"
                               "    actions = [pipeline.Action(op, rank, i) for op, i in order]\n"
                               "    return [(a.op, a.microbatch) for a in pipeline.delayed_weight_passes(actions, rank)]\n",
    }
    return panel.standard_panel(
        lesson, solution, hang_in="bubble_fraction", crash_in="stage_step",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=borrowed)


LESSON = panel.Lesson(REPO / "solutions" / "04_pipeline.ipynb", students, timeout=30)
