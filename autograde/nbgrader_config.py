"""nbgrader configuration for the parakit course.

Read by `python -m autograde.course` (the instructors' command), and by JupyterLab's
formgrader and the plain `nbgrader` command started from any folder with the course's
virtual environment (.ci/setup writes .venv/etc/jupyter/nbgrader_config.py, which loads this
file). The course root is this folder: gradebook.db, source/, release/, submitted/,
autograded/ and feedback/ all live next to this file (they are git-ignored).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:  # `autograde.execute` importable from any cwd
    sys.path.insert(0, os.path.dirname(HERE))
# nbgrader runs `alembic` (it makes the gradebook with it) and the graded kernels from PATH:
# the environment's own bin folder first, also where `.venv/bin/jupyter lab` was started
# without activating it.
BIN = os.path.dirname(sys.executable)
if BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = os.pathsep.join(filter(None, [BIN, os.environ.get("PATH")]))

c = get_config()  # noqa: F821 (provided by traitlets when it loads this file)

c.CourseDirectory.course_id = "parakit"
c.CourseDirectory.root = HERE

# Answer cells: the student sees the signature and docstring, then a stub that raises.
c.ClearSolutions.begin_solution_delimeter = "BEGIN SOLUTION"
c.ClearSolutions.end_solution_delimeter = "END SOLUTION"
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearHiddenTests.begin_test_delimeter = "BEGIN HIDDEN TESTS"
c.ClearHiddenTests.end_test_delimeter = "END HIDDEN TESTS"

# Execution while autograding. A test cell that starts worker processes takes 5-20 s on
# a 2-core CPU; 300 s per cell leaves room for a slow machine, and a student's hang costs
# at most that. On a timeout the kernel is interrupted (parakit cancels every rank) and
# the cell is recorded as failed; the rest of the notebook still runs.
c.Execute.timeout = 300
c.Execute.interrupt_on_timeout = True
c.Execute.startup_timeout = 300  # a kernel's start: 2-3 s idle, minutes seen beside busy loops (nbclient's default: 60)
c.Execute.kernel_name = "python3"  # the ipykernel of the interpreter that runs nbgrader
c.Execute.extra_arguments = ["--IPKernelApp.log_level=ERROR"]  # no start-up warnings per student
# A kernel that dies (os._exit, a segfault) or ignores the interrupt fails only the cell
# it was running: ResilientExecute restarts it and replays the cells before.
c.Autograde.autograde_preprocessors = [
    "autograde.execute.ResilientExecute",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]
