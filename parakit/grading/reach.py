"""What only an exercise's reference answer uses, found from parakit's source.

An exercise forbids the finished thing (say `ddp.BucketedDDP`'s methods); the helpers those
use and nothing else does (a bucket filler, a byte formula) would compute the answer just
as well. `only_used_by(forbidden, kept)` finds them: a parakit function, method or class
joins the withheld set when every place in parakit's source that names it lies inside
something already withheld, and no instructor source (`kept`: the cells that run beside
the student's, the tests, the solution's answers) names it. Starting from the forbidden
functions, this repeats until nothing joins; a class that joins takes its methods along.

A bare name reaches the module-level functions and classes of that name; `self.x` in a
method reaches the `x` of its class's parakit bases and subclasses; any other `.x`, or a
string (getattr's), reaches everything called `x`. So a name shared with anything kept
keeps a helper: the rule withholds less than what only the answer uses, never more. A
method that torch calls by itself (one a non-parakit base class defines, such as
`forward`, or any dunder) counts as named by its class. Module-level code, class bodies,
decorators and default values name things for everyone; parakit.grading is never withheld.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import sys
from typing import Callable, Iterable

__all__ = ["only_used_by", "load_parakit"]


def only_used_by(forbidden: Iterable[Callable], kept: Iterable[str]) -> list[Callable]:
    """The parakit callables (functions, methods, property getters) that only `forbidden`
    and each other name, and no source in `kept` names; `forbidden` itself not included."""
    units, named_by, members = _graph()
    by_code = {code_of(fn): key for key, fn in units.items() if code_of(fn) is not None}
    start = {by_code[code_of(f)] for f in forbidden if code_of(f) in by_code}
    kept_names = {x for source in kept for _, x in _names(ast.parse(source))}
    withheld, grew = set(start), True
    while grew:
        grew = False
        for key in units.keys() - withheld:
            users = named_by.get(key, set())
            if users and users <= withheld and key[-1] not in kept_names:
                withheld |= {key, *members.get(key, ())}
                grew = True
    return [units[key] for key in sorted(withheld - start) if code_of(units[key]) is not None]


@functools.lru_cache(maxsize=1)
def _graph() -> tuple[dict, dict, dict]:
    """units: (module, qualname...) -> the object; named_by: unit -> the units whose code
    names it (("<module>",) for code outside functions, which is never withheld);
    members: a class's unit -> its methods' units."""
    load_parakit()
    units, names_in, named_by, members = {}, {}, {}, {}
    for module in [m for n, m in sorted(sys.modules.items()) if _in_scope(n) and m is not None]:
        try:
            tree = ast.parse(inspect.getsource(module))
        except (OSError, TypeError, SyntaxError):
            continue
        _collect(tree.body, (module.__name__,), module, units, names_in, members)
    resolve = _resolver(units)
    for user, names in names_in.items():
        for name in names:
            for key in resolve(user, name) - {user}:
                named_by.setdefault(key, set()).add(user)
    for cls_key, methods in members.items():  # what torch calls by itself is named by its class
        for key in methods:
            if _called_by_torch(units[cls_key], key[-1]):
                named_by.setdefault(key, set()).add(cls_key)
    return units, named_by, members


def load_parakit() -> None:
    """Import every parakit module (0.3 s once torch is in), so that the graph sees every
    user of a helper, and a rank can unpickle any function the judge withholds."""
    import parakit
    for info in pkgutil.walk_packages(parakit.__path__, "parakit."):
        importlib.import_module(info.name)


def _collect(body, prefix: tuple, owner, units: dict, names_in: dict, members: dict) -> None:
    """Record the functions and classes of `body` (a module's or a class's) as units, what
    each one's code names, and what the code around them names (as the module's)."""
    everyone = names_in.setdefault(("<module>",), set())
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            obj = _member(owner, node.name)
            everyone |= _names(*node.decorator_list, *node.args.defaults, *node.args.kw_defaults)
            if obj is not None:
                units[prefix + (node.name,)] = obj
                names_in[prefix + (node.name,)] = _names(*node.body)
                if inspect.isclass(owner):
                    members.setdefault(prefix, set()).add(prefix + (node.name,))
        elif isinstance(node, ast.ClassDef):
            cls = getattr(owner, node.name, None) if not inspect.isclass(owner) else owner.__dict__.get(node.name)
            everyone |= _names(*node.bases, *node.keywords, *node.decorator_list)
            if inspect.isclass(cls):
                units[prefix + (node.name,)] = cls
                _collect(node.body, prefix + (node.name,), cls, units, names_in, members)
        elif not (isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]):
            everyone |= _names(node)


def _member(owner, name: str):
    """The function `name` defines in `owner` (a module or class), unwrapped from
    staticmethod, classmethod and property (its getter); None if it is not one."""
    obj = owner.__dict__.get(name) if inspect.isclass(owner) else getattr(owner, name, None)
    obj = getattr(obj, "fget", None) or getattr(obj, "__func__", obj)
    return obj if code_of(obj) is not None else None


def _called_by_torch(cls, name: str) -> bool:
    return name.startswith("__") or any(hasattr(base, name) for base in cls.__mro__[1:]
                                        if not _in_scope(base.__module__))


def _names(*nodes) -> set[tuple[str, str]]:
    """What `nodes` name: ("bare", x) for a name x, ("self", x) for self.x, cls.x or super().x,
    ("attr", x) for any other .x and for a string that could be a name (getattr's)."""
    out = set()
    for node in nodes:
        for sub in ast.walk(node) if node is not None else ():
            if isinstance(sub, ast.Name):
                out.add(("bare", sub.id))
            elif isinstance(sub, ast.Attribute):
                mine = (isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls") or
                        isinstance(sub.value, ast.Call) and isinstance(sub.value.func, ast.Name)
                        and sub.value.func.id == "super")
                out.add(("self" if mine else "attr", sub.attr))
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value.isidentifier():
                out.add(("attr", sub.value))
    return out


def _resolver(units: dict):
    """resolve(user, (kind, x)) -> the units that name may reach: a bare name reaches the
    module-level functions and classes called x; self.x in a method of class C reaches the
    x of C's parakit bases and subclasses (anything called x where none has one); any other
    .x reaches every function or method called x."""
    top, anywhere = {}, {}
    for key in units:
        anywhere.setdefault(key[-1], set()).add(key)
        if len(key) == 2:
            top.setdefault(key[-1], set()).add(key)
    classes = {key: obj for key, obj in units.items() if inspect.isclass(obj)}

    def family(cls_key) -> set:
        cls = classes[cls_key]
        return {k for k, other in classes.items() if issubclass(other, cls) or issubclass(cls, other)}

    def resolve(user: tuple, name: tuple[str, str]) -> set:
        kind, x = name
        if kind == "bare":
            return top.get(x, set())
        if kind == "self" and user[:-1] in classes:
            found = {k + (x,) for k in family(user[:-1]) if k + (x,) in units}
            if found:
                return found
        return anywhere.get(x, set())

    return resolve


def code_of(fn):
    """The code object a function (or a bound or decorated one) runs; None for what runs none."""
    fn = getattr(fn, "__func__", fn)
    try:
        fn = inspect.unwrap(fn)
    except ValueError:
        return None
    return getattr(fn, "__code__", None)


def _in_scope(module_name: str) -> bool:
    inside = module_name == "parakit" or module_name.startswith("parakit.")
    return inside and not module_name.startswith("parakit.grading")
