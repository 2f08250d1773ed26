"""The package's shape: no import cycles, no jaxsim import inside a function, command lines only
in jaxsim/cli/, the layers in LAYERS (storage at the bottom, formats below the workflows); long
modules are reported, not failed (the rule is "a module holds one concept", docs/layout.md).

Imports inside functions were how cycles used to be dodged; with none allowed, the import graph
below is the whole dependency structure, and it must stay acyclic.
"""
from __future__ import annotations

import ast
import pathlib
import warnings

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxsim"
# A prompt to look again at a module's concept, not a limit.
SOFT_LINES = 500

# Which jaxsim modules a layer may import (docs/layout.md): 'allowed' lists the only ones,
# 'forbidden' the ones above it. A prefix names a module and everything under it.
LAYERS = {
    # The bottom: paths, atomic writes, the workdir lock, TensorBoard scalars.
    "jaxsim.storage": {"allowed": ("jaxsim.storage", "jaxsim.errors", "jaxsim.registry")},
    # On-disk model formats: above storage and models, below every workflow that uses them.
    "jaxsim.formats": {"forbidden": ("jaxsim.encode", "jaxsim.calibrate", "jaxsim.train",
                                     "jaxsim.eval", "jaxsim.cli", "jaxsim.search",
                                     "jaxsim.serve", "jaxsim.plan", "jaxsim.export")},
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, ast.AST]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` depends on pkg.sub when that is a module, else on pkg.
            found += [(f"{base}.{alias.name}", node) for alias in node.names]
            found.append((base, node))
    return found


def _graph():
    modules = _modules()
    graph, inner = {}, []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = sorted({node.lineno for target, node in
                                _imports(fn, name, path.name == "__init__.py")
                                if target.split(".")[0] == "jaxsim"})
                inner += [f"{path.relative_to(PACKAGE.parent)}:{n} imports jaxsim inside "
                          f"{fn.name}()" for n in lines]
        deps = set()
        for target, node in _imports(tree, name, path.name == "__init__.py"):
            submodules = [f"{target}.{a.name}" for a in getattr(node, "names", [])]
            if isinstance(node, ast.ImportFrom) and target not in submodules and any(
                    s in modules for s in submodules):
                continue  # counted through the submodule itself
            # A module's own parent packages are initialized before it; not an edge.
            if target in modules and target != name and not name.startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    return graph, inner


def test_no_jaxsim_import_inside_functions():
    _, inner = _graph()
    assert not inner, "\n".join(inner)


def test_no_import_cycles():
    graph, _ = _graph()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)


def _jaxsim_imports(tree: ast.AST):
    """(line, module) for each jaxsim module a file imports: `from jaxsim import x` names
    jaxsim.x; a plain `import jaxsim` names the package (and so all it imports)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "jaxsim":
            names = [f"jaxsim.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        yield from ((node.lineno, n) for n in names if n.split(".")[0] == "jaxsim")


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _layer_offenders(layer: str) -> list[str]:
    rule = LAYERS[layer]
    offenders = []
    for name, path in _modules().items():
        if not _under(name, (layer,)):
            continue
        for line, target in _jaxsim_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if ("allowed" in rule and not _under(target, rule["allowed"])) or (
                    _under(target, rule.get("forbidden", ()))):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    return offenders


def test_storage_imports_only_storage_errors_and_registry():
    assert "jaxsim.storage.store" in _modules()  # the walk sees the layer
    offenders = _layer_offenders("jaxsim.storage")
    assert not offenders, "\n".join(offenders)


def test_formats_import_no_workflow_above_them():
    assert "jaxsim.formats.pretrained" in _modules()
    offenders = _layer_offenders("jaxsim.formats")
    assert not offenders, "\n".join(offenders)


def test_layer_check_names_each_offending_import(tmp_path, monkeypatch):
    """The check itself: a planted upward import is one line naming file, line and module."""
    package = tmp_path / "jaxsim"
    (package / "storage").mkdir(parents=True)
    (package / "storage" / "bad.py").write_text(
        "import os\nfrom jaxsim.errors import JaxsimError\nfrom jaxsim import encode\n")
    monkeypatch.setitem(globals(), "PACKAGE", package)
    assert _layer_offenders("jaxsim.storage") == ["jaxsim/storage/bad.py:3 imports jaxsim.encode"]


def test_only_jaxsim_cli_parses_command_lines():
    """argparse (and so a parser, a Namespace) belongs to jaxsim/cli/: library modules take plain
    arguments."""
    offenders = []
    for name, path in _modules().items():
        if name == "jaxsim.cli" or name.startswith("jaxsim.cli."):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(target.split(".")[0] == "argparse"
               for target, _ in _imports(tree, name, path.name == "__init__.py")):
            offenders.append(str(path.relative_to(PACKAGE.parent)))
    assert "jaxsim.cli.main" in _modules()  # the walk sees the command package
    assert not offenders, f"argparse imported outside jaxsim/cli/: {offenders}"


def test_long_modules_are_reported_not_failed():
    counts = {p.relative_to(PACKAGE.parent): len(p.read_text(encoding="utf-8").splitlines())
              for p in _modules().values()}
    assert pathlib.Path("jaxsim/encode.py") in counts  # the walk found the package
    for path, n in sorted(counts.items()):
        if n > SOFT_LINES:
            warnings.warn(f"{path}: {n} lines; does it still hold one concept? "
                          "(docs/layout.md)", stacklevel=1)
