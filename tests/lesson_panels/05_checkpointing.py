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

# Wrong techniques with the right output and, without dropout, the right gradients.
CHECKPOINT_KEEPS_EVERYTHING = '''def my_checkpoint(fn, *inputs):
    return fn(*inputs)                        # autograd keeps every activation inside fn
'''

CHECKPOINT_FORGETS_THE_RNG = '''class MyCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, anchor, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.random.fork_rng(devices=[]):   # the RNG goes on as without, but the recomputation draws new masks
            with torch.enable_grad():
                output = ctx.fn(*inputs)
        torch.autograd.backward(output, grad_output)
        return (None, None, *[x.grad for x in inputs])


def my_checkpoint(fn, *inputs):
    return MyCheckpoint.apply(fn, torch.empty(0, requires_grad=True), *inputs)
'''

CHECKPOINT_FORGETS_THE_DEVICE_GENERATOR = '''class MyCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, anchor, *inputs):
        ctx.fn, ctx.state = fn, torch.get_rng_state()   # the CPU's generator only: on a GPU dropout draws from its own
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
        return (None, None, *[x.grad for x in inputs])


def my_checkpoint(fn, *inputs):
    return MyCheckpoint.apply(fn, torch.empty(0, requires_grad=True), *inputs)
'''

SEQUENTIAL_CEIL = '''def my_checkpoint_sequential(functions, segments, input):
    functions = list(functions)
    if not 1 <= segments <= len(functions):
        raise ValueError(f"segments={segments} is out of range")
    size = math.ceil(len(functions) / segments)   # 10 in 4: 3, 3, 3, 1
    for s in range(segments):
        input = ck.checkpoint(nn.Sequential(*functions[s * size:(s + 1) * size]), input)
    return input
'''

SEQUENTIAL_EACH_ALONE = '''def my_checkpoint_sequential(functions, segments, input):
    functions = list(functions)
    if not 1 <= segments <= len(functions):
        raise ValueError(f"segments={segments} is out of range")
    for f in functions:                       # every function its own segment
        input = ck.checkpoint(f, input)
    return input
'''

# Right, written otherwise: full marks.
OTHERWISE = {
    "my_checkpoint": '''class MyCheckpoint(torch.autograd.Function):
    """The RNG states set and put back by hand, without fork_rng; fn runs under no_grad explicitly."""

    @staticmethod
    def forward(ctx, fn, anchor, *inputs):
        ctx.fn, ctx.rng = fn, torch.get_rng_state()
        ctx.gpu_rng = {x.device: torch.get_device_module(x.device).get_rng_state(x.device)
                       for x in inputs if x.device.type != "cpu"}
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        detached = tuple(x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors)
        now = torch.get_rng_state()
        gpu_now = {d: torch.get_device_module(d).get_rng_state(d) for d in ctx.gpu_rng}
        torch.set_rng_state(ctx.rng)
        for d, state in ctx.gpu_rng.items():
            torch.get_device_module(d).set_rng_state(state, d)
        try:
            with torch.enable_grad():
                output = ctx.fn(*detached)
        finally:
            torch.set_rng_state(now)
            for d, state in gpu_now.items():
                torch.get_device_module(d).set_rng_state(state, d)
        torch.autograd.backward([output], [grad_output])
        return (None, None) + tuple(x.grad for x in detached)


def my_checkpoint(fn, *inputs):
    return MyCheckpoint.apply(fn, torch.zeros(0).requires_grad_(), *inputs)
''',
    "my_checkpoint_sequential": '''import functools


def my_checkpoint_sequential(functions, segments, input):
    functions = list(functions)
    if segments < 1 or segments > len(functions):
        raise ValueError(f"{segments} segments for {len(functions)} functions")
    for part in torch.tensor_split(torch.arange(len(functions)), segments):   # 10 in 4: 3, 3, 2, 2
        chain = [functions[i] for i in part.tolist()]
        input = ck.checkpoint(lambda x, chain=chain: functools.reduce(lambda h, f: f(h), chain, x), input)
    return input
''',
}


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 05. The hard-coder's checkpoint has no anchor input (parameters get no
    gradient when no input requires grad, as in some hidden cases), its checkpoint_sequential
    puts the remainder in the last segment as torch does (the peak differs when n % k != 0,
    hidden only) and its best segment count is a table of the visible cases (each 0 on the
    hidden tests); the borrower calls parakit's checkpoint, checkpoint_sequential and
    best_segments (each 0 by the tripwires); the kernel hangs in the segment count and dies in
    checkpoint_sequential.

    Wrong techniques, each 0 on its exercise: `wrong_technique`'s checkpoint just calls the
    function (the right output, gradients and RNG; autograd keeps every activation) and its
    segments are ceil(n/k) long (10 in 4: 3, 3, 3, 1; the same inputs kept, another peak and
    other recomputations, hidden only); the student whose kernel hangs
    also forks the RNG in the recomputation without restoring the recorded state (another
    dropout mask), and the one with missing cells (checkpoint's tests deleted) checkpoints
    every function alone; `cpu_generator_only` records and restores the CPU's generator alone
    (right on the CPU, another dropout mask on the emulated GPU box's hidden case). `otherwise`
    is right and written differently (the RNG states put back by hand, segments by
    torch.tensor_split, each a closure): full marks."""
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
    full = panel.full_solution(panel.load(lesson), panel.load(solution))
    wrong = {"my_checkpoint": CHECKPOINT_KEEPS_EVERYTHING, "my_checkpoint_sequential": SEQUENTIAL_CEIL}
    students = panel.standard_panel(
        lesson, solution, hang_in="best_segment_count", crash_in="my_checkpoint_sequential",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=borrowed,
        extra=[panel.Student("wrong_technique", {lesson.name: panel.with_sources(full, wrong)},
                             {"test_best_segment_count": pts["test_best_segment_count"]}),
               panel.Student("cpu_generator_only", {lesson.name: panel.with_sources(
                   full, {"my_checkpoint": CHECKPOINT_FORGETS_THE_DEVICE_GENERATOR})},
                   {**pts, "test_my_checkpoint": 0.0}),
               panel.Student("otherwise", {lesson.name: panel.with_sources(full, OTHERWISE)}, dict(pts))])
    hang = next(s for s in students if s.name == "hang_and_crash")
    hang.files[lesson.name] = panel.with_sources(hang.files[lesson.name], {"my_checkpoint": CHECKPOINT_FORGETS_THE_RNG})
    hang.expected.update(test_my_checkpoint=0.0)
    missing = next(s for s in students if s.name == "missing_cells")
    missing.files[lesson.name] = panel.with_sources(missing.files[lesson.name],
                                                    {"my_checkpoint_sequential": SEQUENTIAL_EACH_ALONE})
    missing.expected.update(test_my_checkpoint_sequential=0.0)
    return students


LESSON = panel.Lesson(REPO / "solutions" / "05_checkpointing.ipynb", students, timeout=60)
