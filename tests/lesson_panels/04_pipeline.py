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


# ---- wrong techniques with right values: each 0 on its exercise

GPIPE_ORDER_AS_1F1B = '''def one_f_one_b_order(p, m, rank):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]   # GPipe's order: the same gradients
'''

WHOLE_MODEL_EVERYWHERE = '''def stage_step(model, x, target, loss_fn):
    loss_fn(model(x), target).backward()   # every rank runs every stage: right gradients, nothing sent
    return [q.grad for q in model[dist.get_rank()].parameters()]
'''

ONE_MICROBATCH_AT_A_TIME = '''def gpipe_step(model, x, target, loss_fn, m):
    rank, p = dist.get_rank(), dist.get_world_size()
    stage = model[rank]
    for x_i, target_i in zip(x.chunk(m), target.chunk(m)):   # forward, then backward, of each micro-batch
        inp = x_i
        if rank > 0:
            inp = torch.empty_like(x_i)
            dist.recv(inp, rank - 1)
            inp.requires_grad_()
        out = stage(inp)
        if rank < p - 1:
            dist.send(out.detach(), rank + 1)
            grad = torch.empty_like(out)
            dist.recv(grad, rank + 1)
            out.backward(grad)
        else:
            (loss_fn(out, target_i) / m).backward()
        if rank > 0:
            dist.send(inp.grad, rank - 1)
    return [q.grad for q in stage.parameters()]
'''

ONE_F_ONE_B_AS_GPIPE = '''def gpipe_step(model, x, target, loss_fn, m):
    rank, p = dist.get_rank(), dist.get_world_size()
    stage = model[rank]
    warmup = min(p - 1 - rank, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]       # 1F1B's order: the same gradients, fewer held
    xs, ts, kept, pending = x.chunk(m), target.chunk(m), {}, []
    for op, i in order:
        if op == "F":
            inp = xs[i]
            if rank > 0:
                inp = torch.empty_like(xs[i])
                dist.recv(inp, rank - 1)
                inp.requires_grad_()
            out = stage(inp)
            if rank < p - 1:
                sent = out.detach()
                pending.append((dist.isend(sent, rank + 1), sent))
            else:
                out = loss_fn(out, ts[i]) / m
            kept[i] = inp, out
        else:
            inp, out = kept.pop(i)
            if rank < p - 1:
                grad = torch.empty_like(out)
                dist.recv(grad, rank + 1)
                out.backward(grad)
            else:
                out.backward()
            if rank > 0:
                pending.append((dist.isend(inp.grad, rank - 1), inp.grad))
    for work, _ in pending:
        work.wait()
    return [q.grad for q in stage.parameters()]
'''

IDLE_OVER_COMPUTE = '''def bubble_fraction(p, m, v=1):
    return (p - 1) / (v * m)   # Megatron's bubble relative to the compute time, not the step
'''

IGNORES_CHUNKS = '''def bubble_fraction(p, m, v=1):
    return (p - 1) / (m + p - 1)   # interleaving forgotten
'''

W_RIGHT_AFTER_B = '''def place_weight_passes(order, p, rank):
    out = []
    for op, i in order:
        out.append((op, i))
        if op == "B":
            out.append(("W", i))   # 1F1B's backward in two pieces: nothing moves into the waits
    return out
'''

W_AT_THE_END = '''def place_weight_passes(order, p, rank):
    return order + [("W", i) for op, i in order if op == "B"]   # every W waits: holds all m micro-batches
'''

# ---- right techniques written another way: full marks

ORDER_BY_COUNTERS = '''def one_f_one_b_order(p, m, rank):
    forwards = backwards = 0
    order = []
    while backwards < m:
        in_flight = forwards - backwards
        if forwards < m and (in_flight < p - rank or forwards < p - 1 - rank):
            order.append(("F", forwards))
            forwards += 1
        else:
            order.append(("B", backwards))
            backwards += 1
    return order
'''

STAGE_WITH_ISEND = '''def stage_step(model, x, target, loss_fn):
    rank, p = dist.get_rank(), dist.get_world_size()
    pending, h = [], x
    if rank:
        h = torch.zeros_like(x)
        dist.irecv(h, src=rank - 1).wait()
        h.requires_grad_(True)
    y = model[rank](h)
    if rank == p - 1:
        y, g = loss_fn(y, target), None
    else:
        sent = y.detach()
        pending.append((dist.isend(sent, dst=rank + 1), sent))
        g = torch.zeros_like(y)
        dist.irecv(g, src=rank + 1).wait()
    torch.autograd.backward(y, g)
    if rank:
        pending.append((dist.isend(h.grad, dst=rank - 1), h.grad))
    for work, _ in pending:
        work.wait()
    return [q.grad for q in model[rank].parameters()]
'''

GPIPE_BACKWARDS_REVERSED = '''def gpipe_step(model, x, target, loss_fn, m):
    rank, p = dist.get_rank(), dist.get_world_size()
    stage, pending, kept = model[rank], [], []
    for x_i, t_i in zip(x.chunk(m), target.chunk(m)):
        h = x_i
        if rank:
            h = torch.zeros_like(x_i)
            dist.irecv(h, src=rank - 1).wait()
            h.requires_grad_(True)
        y = stage(h)
        if rank == p - 1:
            y = loss_fn(y, t_i) * (1.0 / m)
        else:
            sent = y.detach()
            pending.append((dist.isend(sent, dst=rank + 1), sent))
        kept.append((h, y))
    for h, y in reversed(kept):   # backwards last micro-batch first (torchgpipe's order), on every rank alike
        g = None
        if rank < p - 1:
            g = torch.zeros_like(y)
            dist.irecv(g, src=rank + 1).wait()
        torch.autograd.backward(y, g)
        if rank:
            pending.append((dist.isend(h.grad, dst=rank - 1), h.grad))
    for work, _ in pending:
        work.wait()
    return [q.grad for q in stage.parameters()]
'''

IDLE_OVER_STEP = '''def bubble_fraction(p, m, v=1):
    idle = (p - 1) / v     # warm-up plus cool-down, in stage-sized steps of forward and backward
    return idle / (m + idle)
'''

W_BY_POSITION = '''def place_weight_passes(order, p, rank):
    backwards = [i for op, i in order if op == "B"]
    out, done = [], 0
    for op, i in order:
        out.append((op, i))
        if op == "B":
            done += 1
            if done > rank:
                out.append(("W", backwards[done - 1 - rank]))
    out += [("W", i) for i in backwards[len(backwards) - min(rank, len(backwards)):]]
    return out
'''


# 1F1B's order from parakit's zero-bubble filler run with 1F1B's caps (p - r stage-micro-batches
# held on rank r), its W's dropped: a general helper, not withheld; the allowlist does not name it.
FILLER_WITH_1F1B_CAPS = """def one_f_one_b_order(p, m, rank):
    from parakit.pipeline import schedules
    orders = schedules._fill_bubbles(p, m, 1, "loop", [p - r for r in range(p)])
    return [(a.op.name, a.microbatch) for a in orders[rank] if a.op.name != "W"]
"""


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 04. The hard-coder's 1F1B order knows only p = 2 and 4, its stage ignores
    loss_fn (always the squared error), so does its GPipe step, its bubble is a table of the visible cases and its W
    placement knows only ranks 0-3 (each 0 on the hidden tests); the borrower calls parakit's 1F1B builder, parakit's
    pipeline_step (in the stage and in GPipe), parakit's bubble formula and parakit's W placement (each 0 by the
    tripwires); the kernel hangs
    in the bubble formula and dies in the stage.

    Wrong techniques with right gradients, each 0 on its exercise. `wrong_techniques`: GPipe's
    order for 1F1B (the order differs from parakit's); every rank running the whole model in
    the stage (it sends nothing and keeps every stage's activations); GPipe one micro-batch at
    a time, forward then backward (its sends interleave on a middle rank, and it keeps one
    micro-batch's activations, not m); Megatron's bubble relative to the compute, (p-1)/(vm);
    each W right after its B (1F1B's idle time). `wrong_techniques_2`: 1F1B's order in the
    GPipe exercise (it keeps at most p - r micro-batches); the bubble without the chunks; every W
    at the end (it holds all m). Right techniques written another way, full marks
    (`right_another_way`): the 1F1B order from counters of forwards in flight; the stage and
    GPipe with irecv(...).wait() and isend, GPipe's backwards last micro-batch first (the same
    sends, peers and bytes, the same m held); the bubble as idle / (m + idle) with idle
    (p-1)/v; the W's placed by position."""
    full = panel.full_solution(panel.load(lesson), panel.load(solution))

    def student(who, sources, zeroed=()):
        return panel.Student(who, {lesson.name: panel.with_sources(full, sources)}, {**pts, **dict.fromkeys(zeroed, 0.0)})

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
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=borrowed,
        extra=[student("wrong_techniques", {"one_f_one_b_order": GPIPE_ORDER_AS_1F1B, "stage_step": WHOLE_MODEL_EVERYWHERE,
                                            "gpipe_step": ONE_MICROBATCH_AT_A_TIME, "bubble_fraction": IDLE_OVER_COMPUTE,
                                            "place_weight_passes": W_RIGHT_AFTER_B}, pts),
               student("wrong_techniques_2", {"gpipe_step": ONE_F_ONE_B_AS_GPIPE, "bubble_fraction": IGNORES_CHUNKS,
                                              "place_weight_passes": W_AT_THE_END},
                       ["test_gpipe_step", "test_bubble_fraction", "test_place_weight_passes"]),
               student("general_helper", {"one_f_one_b_order": FILLER_WITH_1F1B_CAPS},
                       panel.exercises(panel.load(lesson))["one_f_one_b_order"]),
               student("right_another_way", {"one_f_one_b_order": ORDER_BY_COUNTERS, "stage_step": STAGE_WITH_ISEND,
                                             "gpipe_step": GPIPE_BACKWARDS_REVERSED, "bubble_fraction": IDLE_OVER_STEP,
                                             "place_weight_passes": W_BY_POSITION})])


LESSON = panel.Lesson(REPO / "solutions" / "04_pipeline.ipynb", students, timeout=30)
