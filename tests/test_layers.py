"""parakit's layers run one way: each module imports only modules of its own layer or below,
and never another module's private name. The layers are defined here, once; README.md's
Architecture section describes them."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "parakit"

# Module-name prefixes, bottom to top; a module belongs to the layer of its longest matching prefix.
LAYERS = {
    "base": ("parakit.groups", "parakit.hooks", "parakit.devices", "parakit.comm", "parakit.emulation"),
    "technique": ("parakit.dp", "parakit.ddp", "parakit.zero", "parakit.pipeline", "parakit.checkpoint",
                  "parakit.tensor_parallel", "parakit.parallel3d", "parakit.mesh", "parakit.sequence_parallel",
                  "parakit.context_parallel", "parakit.ulysses", "parakit.moe", "parakit.precision",
                  "parakit.state", "parakit.clip", "parakit.text"),
    "top": ("parakit", "parakit.launcher", "parakit._worker", "parakit.magic", "parakit.grading", "parakit.viz",
            "parakit.train", "parakit.torchrun", "parakit.side_by_side", "parakit.plan"),
}
ORDER = list(LAYERS)


def layer_of(module: str) -> str:
    """The layer of a dotted module name (parakit.grading* is top: it may become a package)."""
    if module.startswith("parakit.grading"):
        return "top"
    matches = [(len(p), layer) for layer, prefixes in LAYERS.items() for p in prefixes
               if module == p or module.startswith(p + ".")]
    if not matches:
        raise LookupError(f"{module} has no layer: add it to LAYERS in tests/test_layers.py")
    return max(matches)[1]


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, package: Path = PACKAGE) -> bool:
    """Whether a dotted parakit name is a module or package (not a function or class)."""
    path = package.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str, str | None]]:
    """(line, imported parakit module, imported name or None) for every import in `source`,
    at any depth (imports inside functions count)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "parakit"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] == "parakit":
                found += [(node.lineno, base, a.name) for a in node.names]
    return found


def offences(source: str, module: str, is_package: bool = False, exists=is_module) -> list[str]:
    """What `module` (its `source`) imports against the layering, one line each."""
    mine, bad = ORDER.index(layer_of(module)), []
    for line, base, name in imports_of(source, module, is_package):
        target = f"{base}.{name}" if name and exists(f"{base}.{name}") else base
        if ORDER.index(layer_of(target)) > mine:
            bad.append(f"{module}:{line} imports {target} ({layer_of(target)} layer) from the "
                       f"{layer_of(module)} layer: move the shared piece down, or the importer up")
        if name and target == base and name.startswith("_") and base != module:
            bad.append(f"{module}:{line} imports {base}'s private name {name}: make it public where it "
                       f"belongs, or keep it in one module")
    return bad


def all_modules() -> list[tuple[str, Path]]:
    return [(module_name(p), p) for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_parakit_module_has_a_layer():
    for module, _ in all_modules():
        layer_of(module)


def test_no_module_imports_above_its_layer_or_a_private_name():
    bad = [line for module, path in all_modules()
           for line in offences(path.read_text(), module, path.name == "__init__.py")]
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("source,module,message", [
    ("from parakit.launcher import device", "parakit.pipeline.runtime",
     "parakit.pipeline.runtime:1 imports parakit.launcher (top layer) from the technique layer"),
    ("from parakit import viz", "parakit.groups",
     "parakit.groups:1 imports parakit.viz (top layer) from the base layer"),
    ("def f():\n    import parakit.train", "parakit.ddp", "parakit.ddp:2 imports parakit.train (top layer)"),
    ("from parakit import device", "parakit.tensor_parallel.random",
     "imports parakit (top layer) from the technique layer"),
    ("from parakit.tensor_parallel.layers import _divisible", "parakit.tensor_parallel.vocab",
     "parakit.tensor_parallel.vocab:1 imports parakit.tensor_parallel.layers's private name _divisible"),
    ("from .layers import _divisible", "parakit.tensor_parallel.vocab",
     "imports parakit.tensor_parallel.layers's private name _divisible"),
])
def test_the_check_names_the_offender(source, module, message):
    assert any(message in line for line in offences(source, module)), offences(source, module)


def test_imports_down_the_layers_and_private_modules_pass():
    assert offences("from parakit.groups import new_subgroups\nfrom parakit import comm", "parakit.mesh") == []
    assert offences("from parakit import _worker, launcher", "parakit.magic") == []
    assert offences("from parakit.ddp import BucketedDDP", "parakit.train") == []
