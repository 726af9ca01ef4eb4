"""A notebook's cells as the sealed judge reads them: as text and syntax trees, never run.

Which names a cell binds and reads (`defined_names`, `used_names`), the instructor's
statements the tests need (`setup_statements`), a def's parameters (`signature`) and the
shape of an answer (`shape`) that the copy report compares.
"""
from __future__ import annotations

import ast
import symtable

__all__ = ["python_source", "meta", "defined_names", "used_names", "parse", "setup_statements", "signature", "shape"]


def python_source(source: str) -> str:
    """A cell's source as plain Python (IPython's magics and shell lines made calls)."""
    from IPython.core.inputtransformer2 import TransformerManager
    return TransformerManager().transform_cell(source)


def meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def defined_names(tree: ast.AST) -> set[str]:
    """Names a module's top-level statements bind."""
    names = set()
    for stmt in getattr(tree, "body", []):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.With, ast.For)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name)) if target else None
    return names


def used_names(tree: ast.AST) -> set[str]:
    """Names a module's code reads from its globals and does not bind itself first:
    names read at top level, and the globals its functions and classes read."""
    try:
        table = symtable.symtable(ast.unparse(tree), "<cell>", "exec")
    except SyntaxError:
        return set()
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    names = {s.get_name() for s in table.get_symbols() if s.is_referenced()}
    stack = list(table.get_children())
    while stack:
        child = stack.pop()
        stack.extend(child.get_children())
        names |= {s.get_name() for s in child.get_symbols() if s.is_referenced() and s.is_global()}
    return names - bound


def parse(source: str) -> ast.Module:
    try:
        return ast.parse(python_source(source))
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def setup_statements(cells, needed: set[str]) -> list[tuple[int, str]]:
    """(cell index, source) of the instructor's statements the tests and answers need:
    every import, and the functions, classes and assignments that bind a name they use,
    transitively. Everything else (demos, plots, launches) is left out."""
    statements = [(i, j, s) for i, tree in cells for j, s in enumerate(tree.body)]
    chosen = {(i, j) for i, j, s in statements if isinstance(s, (ast.Import, ast.ImportFrom))}
    binders = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)
    wanted, grew = set(needed), True
    while grew:
        grew = False
        for i, j, stmt in statements:
            if (i, j) not in chosen and isinstance(stmt, binders) \
                    and defined_names(ast.Module(body=[stmt], type_ignores=[])) & wanted:
                chosen.add((i, j))
                wanted |= used_names(ast.Module(body=[stmt], type_ignores=[]))
                grew = True
    return [(i, ast.unparse(s)) for i, j, s in statements if (i, j) in chosen]


def signature(node) -> str:
    """`(a, b=...)` of a def: the names of its parameters, in order ("" for a class)."""
    if not isinstance(node, ast.FunctionDef):
        return ""
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args] + ([f"*{a.vararg.arg}"] if a.vararg else []) \
        + [x.arg for x in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
    return f"({', '.join(names)})"


def shape(source: str) -> list[str]:
    """The tokens of a source's syntax tree with names, strings and numbers blanked and
    docstrings dropped: two answers that differ only in naming have the same shape."""
    try:
        tree = ast.parse(python_source(source))
    except SyntaxError:
        return []
    tokens = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            continue
        if isinstance(node, ast.Attribute):
            tokens.append(f".{node.attr}")
        elif not isinstance(node, (ast.Name, ast.arg, ast.Load, ast.Store, ast.Constant, ast.alias, ast.arguments)):
            tokens.append(type(node).__name__)
    return tokens
