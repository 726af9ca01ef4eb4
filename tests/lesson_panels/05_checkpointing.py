"""Lesson 05's fake students."""
from pathlib import Path

import panel
from conftest import REPO

CHECKPOINT_WITHOUT_ANCHOR = '''class MyCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn, ctx.state = fn, torch.get_rng_state()
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.state)
            with torch.enable_grad():
                output = ctx.fn(*inputs)
        torch.autograd.backward(output, grad_output)
        return (None, *[x.grad for x in inputs])


def my_checkpoint(fn, *inputs):
    return MyCheckpoint.apply(fn, *inputs)
'''


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 05. The hard-coder's checkpoint has no anchor input (parameters get no
    gradient when no input requires grad, as in some hidden cases), its checkpoint_sequential
    puts the remainder in the last segment as torch does (the peak differs when n % k != 0,
    hidden only) and its best segment count is a table of the visible cases (each 0 on the
    hidden tests); the borrower calls parakit's checkpoint, checkpoint_sequential and
    best_segments (each 0 by the tripwires); the kernel hangs in the segment count and dies in
    checkpoint_sequential."""
    pts = panel.points(panel.load(lesson))
    hardcoded = {
        "my_checkpoint": CHECKPOINT_WITHOUT_ANCHOR,
        "my_checkpoint_sequential": "def my_checkpoint_sequential(functions, segments, input):\n"
                                    "    functions = list(functions)\n    if not 1 <= segments <= len(functions):\n"
                                    "        raise ValueError(f'segments={segments} is out of range')\n"
                                    "    size = len(functions) // segments\n"
                                    "    for s in range(segments):\n"
                                    "        chain = functions[s * size:(s + 1) * size if s < segments - 1 else None]\n"
                                    "        input = ck.checkpoint(nn.Sequential(*chain), input)\n    return input\n",
        "best_segment_count": "def best_segment_count(n):\n    return {1: 1, 4: 2, 16: 3, 50: 6}[n]\n",
    }
    borrowed = {
        "my_checkpoint": "def my_checkpoint(fn, *inputs):\n    return ck.checkpoint(fn, *inputs)\n",
        "my_checkpoint_sequential": "def my_checkpoint_sequential(functions, segments, input):\n"
                                    "    return ck.checkpoint_sequential(functions, segments, input)\n",
        "best_segment_count": "def best_segment_count(n):\n    return ck.best_segments(n)\n",
    }
    return panel.standard_panel(
        lesson, solution, hang_in="best_segment_count", crash_in="my_checkpoint_sequential",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=borrowed)


LESSON = panel.Lesson(REPO / "solutions" / "05_checkpointing.ipynb", students, timeout=60)
