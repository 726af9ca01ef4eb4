"""Lesson 07's fake students."""
from pathlib import Path

import panel
from conftest import REPO

from parakit import mesh, parallel3d


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 07. The hard-coder's cube and mesh groups are tables of the visible cases, and
    its forward and backward use the "input" and "output" axes by name, so they pass on the
    first layer's cube and fail on the swapped one (each 0 on the hidden tests); the borrower
    leans on parakit's rank formulas (cube_rank, mesh_rank), its collective helpers
    (_all_gather, _reduce_scatter) and its linear3d_backward (each 0 by the tripwires); the
    kernel hangs in the cube groups and dies in the mesh groups."""
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
    }
    return panel.standard_panel(
        lesson, solution, hang_in="cube_groups", crash_in="mesh_groups",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=borrowed)


def _source(nb, grade_id: str) -> str:
    return next(c.source for c in nb.cells if panel.nbgrader_meta(c).get("grade_id") == grade_id)


def _replace(source: str, pairs) -> str:
    for old, new in pairs:
        assert old in source, f"the solution no longer contains {old!r}"
        source = source.replace(old, new)
    return source


LESSON = panel.Lesson(REPO / "solutions" / "07_3d_parallelism.ipynb", students, timeout=90)
