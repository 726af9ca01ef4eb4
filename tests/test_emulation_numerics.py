"""The emulated GPU's kernels round as a GPU's do (parakit.emulation.numerics): matrix products
and reductions add in another order than the CPU's, fused multiply-adds round once; so an
exact comparison between fgpu and the CPU fails as it would between a GPU and the CPU, while
fgpu against itself is exact and every result stays within fp32's rounding of the truth.

One fresh interpreter with PARAKIT_EMULATE_GPUS=4 computes everything (`found`); each test
reads its part.
"""
from __future__ import annotations

import pytest

from p2p_order import run_emulated

NUMERICS = '''
import json, torch, torch.nn.functional as F
import parakit
from parakit import emulation, side_by_side
emulation.install(4)
g = torch.Generator().manual_seed(0)
EPS = torch.finfo(torch.float32).eps

def on(device, fn, *inputs):
    return fn(*(x.to(device) for x in inputs)).cpu()

CASES = {  # name -> (function, its inputs)
    "mm": (torch.mm, (torch.randn(32, 64, generator=g), torch.randn(64, 48, generator=g))),
    "linear": (F.linear, (torch.randn(4, 8, 64, generator=g), torch.randn(16, 64, generator=g),
                          torch.randn(16, generator=g))),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
              (torch.randn(48, generator=g), torch.randn(32, 64, generator=g), torch.randn(64, 48, generator=g))),
    "bmm": (torch.bmm, (torch.randn(4, 16, 32, generator=g), torch.randn(4, 32, 16, generator=g))),
    "sum": (lambda x: x.sum(0), (torch.randn(96, 40, generator=g),)),
    "mean": (lambda x: x.mean(-1), (torch.randn(40, 96, generator=g),)),
    "norm": (torch.linalg.vector_norm, (torch.randn(30, 50, generator=g),)),
    "softmax": (lambda x: x.softmax(-1), (torch.randn(16, 96, generator=g),)),
    "addcdiv": (lambda a, b, c: torch.addcdiv(a, b, c.abs() + 0.5, value=-1e-3),
                tuple(torch.randn(4096, generator=g) for _ in range(3))),
}
SCALE = {  # the sum of magnitudes an element's rounding scales with
    "mm": lambda a, b: a.abs() @ b.abs(), "linear": lambda x, w, b: x.abs() @ w.abs().T + b.abs(),
    "addmm": lambda c, a, b: 0.5 * c.abs() + 2 * a.abs() @ b.abs(),
    "bmm": lambda a, b: a.abs() @ b.abs(), "sum": lambda x: x.abs().sum(0), "mean": lambda x: x.abs().mean(-1),
    "norm": torch.linalg.vector_norm, "softmax": lambda x: x.softmax(-1), "addcdiv": lambda a, b, c: a.abs(),
}
found = {}
for name, (fn, inputs) in CASES.items():
    cpu, fgpu = fn(*inputs), on("fgpu:0", fn, *inputs)
    exact = fn(*(x.double() for x in inputs))
    found[name] = {
        "differing": int((cpu != fgpu).sum()), "elements": cpu.numel(), "equal": torch.equal(cpu, fgpu),
        "close": torch.allclose(fgpu, cpu, rtol=1.3e-6, atol=1e-5),
        "same_twice": torch.equal(fgpu, on("fgpu:0", fn, *inputs)),
        "same_on_another_gpu": torch.equal(fgpu, on("fgpu:3", fn, *inputs)),
        "error": float(((fgpu.double() - exact).abs() / SCALE[name](*(x.double() for x in inputs))).max() / EPS),
        "cpu_error": float(((cpu.double() - exact).abs() / SCALE[name](*(x.double() for x in inputs))).max() / EPS)}
a, b = torch.randn(64, 128, generator=g).bfloat16(), torch.randn(128, 32, generator=g).bfloat16()
exact = a.double() @ b.double()
found["bf16 mm error in bf16 ulps"] = float(((on("fgpu:0", torch.mm, a, b).double() - exact).abs()
                                             / (exact.abs() * torch.finfo(torch.bfloat16).eps)).max())
def on_the_gpu(a, b):  # the ranks receive their inputs on their own GPU
    return on(parakit.device(), torch.mm, a, b)

def on_the_cpu(a, b):
    return on("cpu", torch.mm, a, b)

both = side_by_side.compare({"on the GPU": on_the_gpu, "on the CPU": on_the_cpu}, *CASES["mm"][1], world_size=2,
                            memory=False)  # a lesson's cell: one product, two kernels, compared exactly
try:
    both.check(rtol=0, atol=0, kernels={"on the GPU": "fgpu's split-K matmul", "on the CPU": "MKL's matmul"})
    found["exact"] = "passed"
except AssertionError as error:
    found["exact"] = str(error).splitlines()[0]
def ones(*shape, dtype=torch.float32):
    return torch.ones(*shape, device="fgpu:0", dtype=dtype)

found["refused"] = []
for misfit in (lambda: ones(2, 3) @ ones(4, 2), lambda: torch.addmm(ones(1), ones(2, 9), ones(8, 2)),
               lambda: torch.bmm(ones(4, 9, 6), ones(4, 5, 6)), lambda: ones(2, 9) @ ones(9, 2, dtype=torch.float64)):
    try:
        misfit()
        found["refused"].append("no error")
    except RuntimeError as error:
        found["refused"].append(str(error).split(" (")[0].split(",")[0])
print(json.dumps(found))
'''
NAMES = ["mm", "linear", "addmm", "bmm", "sum", "mean", "norm", "softmax", "addcdiv"]


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    return run_emulated(tmp_path_factory.mktemp("numerics"), NUMERICS)


@pytest.mark.parametrize("name", NAMES)
def test_fgpu_rounds_otherwise_than_the_cpu_within_fp32s_default_tolerance(found, name):
    case = found[name]
    assert not case["equal"] and case["differing"] > 0, f"{name}: fgpu equals the CPU bit for bit: {case}"
    assert case["close"], f"{name}: {case['differing']} of {case['elements']} elements differ beyond fp32's default"


@pytest.mark.parametrize("name", NAMES)
def test_fgpu_gives_the_same_bits_every_time_and_on_every_device(found, name):
    assert (found[name]["same_twice"], found[name]["same_on_another_gpu"]) == (True, True)


@pytest.mark.parametrize("name", NAMES)
def test_fgpus_kernels_stay_within_fp32s_rounding_of_float64(found, name):
    """Each element's error, in eps times the sum of magnitudes it rounds with, is a few units
    (the CPU's is of the same order): another order of adding, no precision lost."""
    assert found[name]["error"] <= 8, found[name]


def test_half_precision_products_accumulate_in_fp32_as_on_a_gpu(found):
    """A bf16 matmul rounds once, from fp32 sums, to within one bf16 unit; bf16 partial
    products added in bf16 would be off by several."""
    assert found["bf16 mm error in bf16 ulps"] <= 1


def test_an_exact_comparison_between_kernels_names_them_and_the_tolerance_they_need(found):
    message = found["exact"]
    assert message.startswith("on the CPU differs from on the GPU on rank 0: on the CPU (MKL's matmul) and on the GPU "
                              "(fgpu's split-K matmul) differ beyond rtol=0, atol=0 by up to ")
    assert "two different kernels round differently and need that tolerance, atol >= " in message


def test_operands_that_do_not_fit_are_refused_with_the_cpus_error_not_multiplied_in_parts(found):
    assert found["refused"] == ["mat1 and mat2 shapes cannot be multiplied", "mat1 and mat2 shapes cannot be multiplied",
                                "Expected size for first two dimensions of batch2 tensor to be: [4",
                                "expected m1 and m2 to have the same dtype"], found["refused"]
