"""The package's imports point one way (docs/architecture.md): a module imports only
modules of the layers below its own, or of its own package."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "zarrckpt"

# Top to bottom; a name is a top-level module or package of zarrckpt.
LAYERS = [
    {"__main__"},
    {"_cli"},
    {"__init__"},
    {"_manager"},
    {"_tier", "_import", "_copy"},
    {"_inflight", "_run"},
    {"_save"},
    {"_foreign", "_verify", "_metadata", "_objects"},
    {"_restore"},
    {"_commit"},
    {"_seqax"},
    {"_storage", "_options", "_finite"},
    {"_format", "_preemption", "_schedule"},
    {"_util"},
    {"errors", "_deprecated"},
]


def room(module: str) -> str:
    """The top-level module or package `module` (dotted, below zarrckpt) belongs to."""
    return module.split(".")[0]


def imported(path: Path) -> set[str]:
    """The zarrckpt modules `path` imports, dotted below zarrckpt."""
    relative = path.relative_to(PACKAGE).with_suffix("")
    package = list(relative.parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "zarrckpt":
                target = node.module.split(".")[1:]
            else:
                continue
            if target:
                found.add(".".join(target))
            else:  # `from . import x` at the top: a module, or a name of the package's own
                found |= {alias.name if (PACKAGE / alias.name).is_dir() or (PACKAGE / f"{alias.name}.py").exists()
                          else "__init__" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".", 1)[1] for alias in node.names if alias.name.startswith("zarrckpt.")}
    return found


def test_every_module_is_in_a_layer():
    rooms = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in PACKAGE.glob("*")
             if path.suffix == ".py" or (path.is_dir() and any(path.glob("*.py")))}
    assert rooms == set().union(*LAYERS), rooms ^ set().union(*LAYERS)


def test_imports_point_down():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = room(".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        for module in imported(path):
            other = room(module)
            if other != own and layer[other] <= layer[own]:
                upward.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not upward, upward


def test_no_class_is_over_450_lines():
    """A class that grows past this has taken on a second job: give it a collaborator."""
    long = [f"{path.relative_to(PACKAGE.parent)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 450]
    assert not long, long
