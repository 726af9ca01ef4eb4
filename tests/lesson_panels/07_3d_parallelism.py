"""Lesson 07's fake students."""
from pathlib import Path

import panel
from conftest import REPO

from parakit import mesh, parallel3d

CUBE_I_INNERMOST = """def cube_groups(q):
    # groups that cover the ranks, but with i innermost: r = l q^2 + j q + i
    rank = lambda i, j, l: (l * q + j) * q + i
    groups = {"weight": [], "input": [], "output": []}
    for a in range(q):
        for b in range(q):
            groups["weight"].append([rank(v, a, b) for v in range(q)])
            groups["input"].append([rank(a, v, b) for v in range(q)])
            groups["output"].append([rank(a, b, v) for v in range(q)])
    return {axis: sorted(lists) for axis, lists in groups.items()}
"""

FULL_WEIGHT = """def linear3d_forward(x, a, cube):
    # right values, but every rank all-gathers the whole weight (q^3 blocks) and keeps its A_lj
    q, world = cube.q, dist.get_world_size()
    i, j, l = cube.coords
    x_il = torch.empty(q * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_gather_single(x_il, x.contiguous(), group=cube.axis_group(cube.input_axis))
    everything = torch.empty(world * a.shape[0], a.shape[1], dtype=a.dtype, device=a.device)
    dist.all_gather_single(everything, a.contiguous())
    blocks = everything.chunk(world)
    a_lj = torch.cat([blocks[(v * q + j) * q + l] for v in range(q)], dim=1)
    partial = x_il @ a_lj
    y = torch.empty(partial.shape[0] // q, partial.shape[1], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(y, partial, group=cube.axis_group(cube.output_axis))
    return y, x_il, a_lj
"""

ALL_REDUCE_GRADIENTS = """def linear3d_backward(dy, x_il, a_lj, cube):
    # right values, but all-reduces the whole gradients and keeps its piece: q times the bytes of a reduce-scatter
    q = cube.q
    dy_ij = torch.empty(q * dy.shape[0], dy.shape[1], dtype=dy.dtype, device=dy.device)
    dist.all_gather_single(dy_ij, dy.contiguous(), group=cube.axis_group(cube.output_axis))
    dx_il = dy_ij @ a_lj.t()
    dist.all_reduce(dx_il, group=cube.axis_group(cube.input_axis))
    da_lj = x_il.t() @ dy_ij
    dist.all_reduce(da_lj, group=cube.axis_group("weight"))
    return (dx_il.chunk(q)[cube.coord(cube.input_axis)].contiguous(),
            da_lj.chunk(q, dim=1)[cube.coord("weight")].contiguous())
"""

MESH_TP_OUTERMOST = """def mesh_groups(dp, pp, tp):
    # groups that cover the ranks, but with the dimensions in the wrong order: r = (t * pp + p) * dp + d
    rank = lambda d, p, t: (t * pp + p) * dp + d
    groups = {
        "dp": [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "tp": [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
    }
    return {kind: sorted(lists) for kind, lists in groups.items()}
"""

CUBE_BY_TENSOR = """def cube_groups(q):
    # the same groups from a tensor of ranks indexed [i, j, l]
    ranks = torch.arange(q ** 3).view(q, q, q)
    lines = lambda t: sorted(t.reshape(-1, q).tolist())
    return {"weight": lines(ranks.permute(1, 2, 0)), "input": lines(ranks.permute(0, 2, 1)),
            "output": lines(ranks)}
"""

WEIGHT_FIRST = """def linear3d_forward(x, a, cube):
    # the weight's all-gather first, then the input's (as valid); the pieces put side by side with a list
    q = cube.q
    pieces = [torch.empty_like(a) for _ in range(q)]
    dist.all_gather(pieces, a.contiguous(), group=cube.axis_group("weight"))
    a_lj = torch.cat(pieces, dim=1)
    x_il = torch.empty(q * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_gather_single(x_il, x.contiguous(), group=cube.axis_group(cube.input_axis))
    partial = x_il @ a_lj
    y = torch.empty(partial.shape[0] // q, partial.shape[1], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(y, partial, group=cube.axis_group(cube.output_axis))
    return y, x_il, a_lj
"""

DA_FIRST = """def linear3d_backward(dy, x_il, a_lj, cube):
    # dA's reduce-scatter before dX's (as valid), through the list form
    q = cube.q
    dy_ij = torch.empty(q * dy.shape[0], dy.shape[1], dtype=dy.dtype, device=dy.device)
    dist.all_gather_single(dy_ij, dy.contiguous(), group=cube.axis_group(cube.output_axis))
    da_lj = x_il.t() @ dy_ij
    da = torch.empty(da_lj.shape[0], da_lj.shape[1] // q, dtype=dy.dtype, device=dy.device)
    dist.reduce_scatter(da, [p.contiguous() for p in da_lj.chunk(q, dim=1)], group=cube.axis_group("weight"))
    dx_il = dy_ij @ a_lj.t()
    dx = torch.empty(dx_il.shape[0] // q, dx_il.shape[1], dtype=dy.dtype, device=dy.device)
    dist.reduce_scatter_single(dx, dx_il, group=cube.axis_group(cube.input_axis))
    return dx, da
"""

MESH_BY_TENSOR = """def mesh_groups(dp, pp, tp):
    # the same groups from a tensor of ranks indexed [d, p, t]
    ranks = torch.arange(dp * pp * tp).view(dp, pp, tp)
    lines = lambda t, n: sorted(t.reshape(-1, n).tolist())
    return {"dp": lines(ranks.permute(1, 2, 0), dp), "pp": lines(ranks.permute(0, 2, 1), pp), "tp": lines(ranks, tp)}
"""

HSDP_OVER_THE_WORLD = """def hsdp_reduce(grad_flat, shard_group, replicate_group):
    # right values, but the whole gradient all-reduced over every rank, then this rank's segment kept
    total = grad_flat.clone()
    dist.all_reduce(total)
    return total.chunk(dist.get_world_size(shard_group))[dist.get_rank(shard_group)] / dist.get_world_size()
"""

HSDP_PLAIN_FSDP = """def hsdp_reduce(grad_flat, shard_group, replicate_group):
    # plain FSDP: one reduce-scatter over all the ranks, each keeping 1/(S R) of the gradient
    n = dist.get_world_size()
    shard = torch.empty(grad_flat.numel() // n, dtype=grad_flat.dtype, device=grad_flat.device)
    dist.reduce_scatter_single(shard, grad_flat.contiguous())
    return shard / n
"""

HSDP_REPLICAS_FIRST = """def hsdp_reduce(grad_flat, shard_group, replicate_group):
    # right values, but the whole gradient crosses the nodes: all-reduced over the replicas before the reduce-scatter
    s, r = dist.get_world_size(shard_group), dist.get_world_size(replicate_group)
    total = grad_flat.clone()
    dist.all_reduce(total, group=replicate_group)
    shard = torch.empty(grad_flat.numel() // s, dtype=grad_flat.dtype, device=grad_flat.device)
    dist.reduce_scatter_single(shard, total, group=shard_group)
    return shard / (s * r)
"""

HSDP_LIST_FORM = """def hsdp_reduce(grad_flat, shard_group, replicate_group):
    # averaged first, then the list form of reduce-scatter (as valid)
    s = dist.get_world_size(shard_group)
    pieces = list((grad_flat / (s * dist.get_world_size(replicate_group))).chunk(s))
    shard = torch.empty_like(pieces[0])
    dist.reduce_scatter(shard, pieces, group=shard_group)
    dist.all_reduce(shard, group=replicate_group)
    return shard
"""

HSDP_BORROWED = """def hsdp_reduce(grad_flat, shard_group, replicate_group):
    # parakit's HSDP does the reduction: a module holding one parameter of the gradient's size
    model = FullyShardedDataParallel(nn.Linear(grad_flat.numel(), 1, bias=False).to(grad_flat.device),
                                     group=shard_group, replicate_group=replicate_group)
    model._reduce_scatter(model.units[0], [grad_flat.view(1, -1)])
    model.finish_gradient_synchronization()
    return model.units[0].shard.grad
"""


# Both group builders from parakit's general grid helper (used by parakit.mesh, so nothing
# withholds it): the exercises' allowlists do not name it, so each scores 0.
GRID_GROUPS = {
    "cube_groups": "def cube_groups(q):\n    from parakit import groups\n"
                   "    return {axis: sorted(groups.grid_groups((q, q, q), [i]))\n"
                   "            for i, axis in enumerate(('weight', 'input', 'output'))}\n",
    "mesh_groups": "def mesh_groups(dp, pp, tp):\n    from parakit import groups\n"
                   "    return {kind: sorted(groups.grid_groups((dp, pp, tp), [axis]))\n"
                   "            for axis, kind in enumerate(('dp', 'pp', 'tp'))}\n",
}


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 07. The hard-coder's cube and mesh groups are tables of the visible cases, and
    its forward and backward use the "input" and "output" axes by name, so they pass on the
    first layer's cube and fail on the swapped one (each 0 on the hidden tests); the borrower
    leans on parakit's rank formulas (cube_rank, mesh_rank), its collective helpers
    (_all_gather, _reduce_scatter) and its linear3d_backward (each 0 by the tripwires); the
    kernel hangs in the cube groups and dies in the mesh groups. HSDP's reduction: the
    hard-coder's assumes 2 nodes of 2 (the visible case), the borrower's calls parakit's HSDP.
    Techniques: `wrong_techniques` numbers the cube with i innermost and the mesh with tp
    outermost (groups that cover the ranks, in the wrong order of dimensions), all-gathers the
    whole weight in the forward, all-reduces the gradients in the backward and all-reduces the
    whole gradient over the world for HSDP (right values; 0 on each exercise, the last three by
    the traffic); `hsdp_plain_fsdp` reduce-scatters over all the ranks (a shard of 1/(S R), not
    1/S) and `hsdp_replicas_first` all-reduces the whole gradient across the nodes before its
    reduce-scatter (right values, S times the bytes across): 0 on HSDP's test, full marks on the
    rest; `other_ways` (groups from a
    tensor of ranks, the weight gathered first with the list form, dA reduce-scattered before
    dX, HSDP's gradient averaged first and reduce-scattered with the list form) keeps full
    marks."""
    full = panel.full_solution(panel.load(lesson), panel.load(solution))
    pts = panel.points(panel.load(lesson))
    cubes = {q: {k[0]: v for k, v in parallel3d.cube_groups(q).items() if len(k) == 1} for q in (1, 2, 3)}
    meshes = {s: mesh.mesh_groups(*s) for s in ((2, 2, 2), (1, 2, 4), (3, 1, 2))}
    fixed_axes = [("cube.axis_group(cube.input_axis)", 'cube.axis_group("input")'),
                  ("cube.axis_group(cube.output_axis)", 'cube.axis_group("output")')]
    hardcoded = {
        "cube_groups": f"def cube_groups(q):\n    return {cubes!r}[q]\n",
        "mesh_groups": f"def mesh_groups(dp, pp, tp):\n    return {meshes!r}[(dp, pp, tp)]\n",
        **{gid: _replace(_source(full, gid), fixed_axes) for gid in ("linear3d_forward", "linear3d_backward")},
        "hsdp_reduce": _replace(_source(full, "hsdp_reduce"), [(
            "s, r = dist.get_world_size(shard_group), dist.get_world_size(replicate_group)", "s, r = 2, 2")]),
    }
    borrowed = {
        "cube_groups": _replace(_source(full, "cube_groups"), [("rank = lambda i, j, l: (i * q + j) * q + l",
                                                                 "rank = lambda i, j, l: p3d.cube_rank(i, j, l, q)")]),
        "linear3d_forward": "def linear3d_forward(x, a, cube):\n"
                            "    x_il = p3d._all_gather(x, cube.axis_group(cube.input_axis), dim=0)\n"
                            "    a_lj = p3d._all_gather(a, cube.axis_group('weight'), dim=1)\n"
                            "    return p3d._reduce_scatter(x_il @ a_lj, cube.axis_group(cube.output_axis), dim=0), x_il, a_lj\n",
        "linear3d_backward": "def linear3d_backward(dy, x_il, a_lj, cube):\n"
                             "    return p3d.linear3d_backward(dy, x_il, a_lj, cube)\n",
        "mesh_groups": _replace(_source(full, "mesh_groups"), [("rank = lambda d, p, t: (d * pp + p) * tp + t",
                                                                 "rank = lambda d, p, t: pmesh.mesh_rank(d, p, t, dp, pp, tp)")]),
        "hsdp_reduce": HSDP_BORROWED,
    }
    all_but_hsdp = {test: score for test, score in pts.items() if test != "test_hsdp_reduce"}
    techniques = [
        panel.Student("wrong_techniques", {lesson.name: panel.with_sources(
            full, {"cube_groups": CUBE_I_INNERMOST, "linear3d_forward": FULL_WEIGHT,
                   "linear3d_backward": ALL_REDUCE_GRADIENTS, "mesh_groups": MESH_TP_OUTERMOST,
                   "hsdp_reduce": HSDP_OVER_THE_WORLD})}, {}),
        panel.Student("hsdp_plain_fsdp", {lesson.name: panel.with_sources(full, {"hsdp_reduce": HSDP_PLAIN_FSDP})},
                      all_but_hsdp),
        panel.Student("hsdp_replicas_first", {lesson.name: panel.with_sources(
            full, {"hsdp_reduce": HSDP_REPLICAS_FIRST})}, all_but_hsdp),
        panel.Student("other_ways", {lesson.name: panel.with_sources(
            full, {"cube_groups": CUBE_BY_TENSOR, "linear3d_forward": WEIGHT_FIRST,
                   "linear3d_backward": DA_FIRST, "mesh_groups": MESH_BY_TENSOR,
                   "hsdp_reduce": HSDP_LIST_FORM})}, dict(pts)),
    ]
    groups = panel.exercises(panel.load(lesson))
    techniques.append(panel.Student("general_helper", {lesson.name: panel.with_sources(full, GRID_GROUPS)},
                                    {**pts, **{t: 0.0 for a in GRID_GROUPS for t in groups[a]}}))
    return panel.standard_panel(
        lesson, solution, hang_in="cube_groups", crash_in="mesh_groups",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=borrowed, extra=techniques)


def _source(nb, grade_id: str) -> str:
    return next(c.source for c in nb.cells if panel.nbgrader_meta(c).get("grade_id") == grade_id)


def _replace(source: str, pairs) -> str:
    for old, new in pairs:
        assert old in source, f"the solution no longer contains {old!r}"
        source = source.replace(old, new)
    return source


LESSON = panel.Lesson(REPO / "solutions" / "07_3d_parallelism.ipynb", students, timeout=90)
