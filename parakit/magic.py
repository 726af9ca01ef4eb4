"""`%%ranks N`: run a notebook cell on every rank.

    %load_ext parakit

    %%ranks 4
    import parakit, torch, torch.distributed as dist
    x = torch.ones(2, device=parakit.device()) * dist.get_rank()   # this rank's GPU under NCCL
    dist.all_reduce(x)
    x                      # the last expression is printed by every rank

Each rank keeps its own namespace from cell to cell (names defined in one `%%ranks 4`
cell are there in the next) for as long as its pool lives; a failure restarts the pool,
and the next cell says that earlier names are gone. Output, errors and hangs are handled
as in `parakit.launch`. Options: `--backend {auto,gloo,nccl}` and `--timeout SECONDS`.
"""
from __future__ import annotations

import argparse
import linecache
import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class

from parakit import _worker, launcher


def register(ipython) -> None:
    ipython.register_magics(RanksMagics)


def _parse(line: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="%%ranks", exit_on_error=False, add_help=False)
    parser.add_argument("world_size", type=int)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--timeout", type=float, default=launcher.DEFAULT_TIMEOUT)
    try:
        return parser.parse_args(shlex.split(line))
    except (argparse.ArgumentError, SystemExit, ValueError) as error:
        raise UsageError(f"%%ranks {line!r}: {error}. Usage: %%ranks N [--backend gloo] [--timeout 60]") from None


@magics_class
class RanksMagics(Magics):
    def __init__(self, shell):
        super().__init__(shell)
        self.cells = 0
        self.generations: dict[tuple[int, str], int | None] = {}  # pool that ran our last cell (None: gone)

    @cell_magic
    def ranks(self, line: str, cell: str) -> None:
        """Run this cell on N ranks: %%ranks N [--backend gloo|nccl|auto] [--timeout S]."""
        __tracebackhide__ = True
        options = _parse(line)
        self.cells += 1
        filename = f"<ranks-cell-{self.cells}>"
        lines = cell.splitlines(keepends=True)
        linecache.cache[filename] = (len(cell), None, lines, filename)  # shipped for tracebacks
        key = (options.world_size, launcher.resolve_backend(options.backend, options.world_size))
        live = launcher.pool_generation(*key)
        if key in self.generations and (live is None or live != self.generations[key]):
            print(f"(new rank processes for world size {key[0]}: names defined by earlier %%ranks cells are gone)")
        try:
            launcher.launch(_worker.run_cell, cell, filename, world_size=options.world_size,
                            backend=options.backend, timeout=options.timeout)
        finally:
            self.generations[key] = launcher.pool_generation(*key)
