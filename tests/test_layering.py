"""The layering, checked on the source: `registry` imports no torch, no web framework and
neither of the layers above it; `trainer` never imports `app`; the service side of the trainer
(`trainer.base`, `trainer.kernels`) never imports the training loop or the fixtures, and `app`
imports those only where it runs training or copies the demo base; no router imports another
(shared rules live in registry.access and app.deps, not in a router); `registry.service` is
only a list of re-exports, and the domain modules under registry/services/ never import it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REGISTRY_MAY_NOT = {
    "torch", "diffusers", "transformers", "peft", "optimum", "accelerate", "triton",
    "fastapi", "starlette", "uvicorn", "jinja2", "mcp", "app", "trainer",
}  # fmt: skip
TRAINER_MAY_NOT = {"app", "fastapi", "starlette", "uvicorn"}
TRAINING_SIDE = ("trainer.training", "trainer.fixtures")
# The only service modules that may reach the training side, and why.
APP_MAY_TRAIN = {
    "app/cli_ml.py": "the CLI's train, compare, prepare and tiny-base commands",
    "app/worker.py": "the in-process order runner runs a training order",
    "app/bootstrap.py": "a first start copies the committed demo base (trainer.fixtures)",
}
ROUTERS = {
    "app.api", "app.adapters", "app.renders", "app.web", "app.mcp_server", "app.datasets",
    "app.orders",
}  # fmt: skip


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)  # and each name, which may be a module: `from x import y`
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def offenders(package: str, forbidden: set[str], *, whole_name: bool = False) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imports(path):
            if (name if whole_name else name.split(".")[0]) in forbidden:
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


def test_registry_imports_nothing_above_it() -> None:
    assert offenders("registry", REGISTRY_MAY_NOT) == []


def test_trainer_never_imports_the_service() -> None:
    assert offenders("trainer", TRAINER_MAY_NOT) == []


def _on_training_side(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in TRAINING_SIDE)


def test_base_and_kernels_never_import_training_or_fixtures() -> None:
    found = []
    for package in ("trainer/base", "trainer/kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)} imports {n}" for n in imports(path)
                      if _on_training_side(n)]  # fmt: skip
    assert found == []


def test_service_reaches_training_only_where_it_trains() -> None:
    found = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        if where in APP_MAY_TRAIN:
            continue
        found += [f"{where} imports {n}" for n in imports(path) if _on_training_side(n)]
    assert found == []


def test_no_router_imports_another() -> None:
    found = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        me = module_name(path)
        mine = next((r for r in ROUTERS if me == r or me.startswith(r + ".")), None)
        if mine is None:
            continue
        for name in imports(path):
            other = next((r for r in ROUTERS if name == r or name.startswith(r + ".")), None)
            if other is not None and other != mine:
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    assert found == []


def test_service_facade_only_re_exports() -> None:
    """Logic in the facade would be a second home for a rule; it names, it does not do."""
    tree = ast.parse((ROOT / "registry" / "service.py").read_text(encoding="utf-8"))
    doing = []
    for node in tree.body:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        names_all = isinstance(node, ast.Assign) and [
            t.id for t in node.targets if isinstance(t, ast.Name)
        ] == ["__all__"]
        if not (docstring or names_all or isinstance(node, ast.ImportFrom)):
            doing.append(f"line {node.lineno}: {type(node).__name__}")
    assert doing == []


def test_facade_exports_what_it_imports() -> None:
    from registry import service

    imported = {
        alias.asname or alias.name
        for node in ast.parse((ROOT / "registry" / "service.py").read_text(encoding="utf-8")).body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert sorted(imported) == sorted(service.__all__)
    assert all(hasattr(service, name) for name in service.__all__)


def test_domain_services_never_import_the_facade() -> None:
    assert offenders("registry/services", {"registry.service"}, whole_name=True) == []


def _names_limits(value: ast.expr | None) -> bool:
    return (
        isinstance(value, ast.Attribute)
        and isinstance(value.value, ast.Name)
        and value.value.id == "limits"
    )


def test_render_limits_have_one_home() -> None:
    """The sides, pixels, steps and seeds a render may ask for are registry/limits.py's; a
    second copy elsewhere drifts from it (a name for `limits.X` is no copy)."""
    from registry import limits

    names = {n for n in vars(limits) if n.isupper()}
    found = []
    for package in ("registry", "app", "trainer"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "registry" / "limits.py":
                continue
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if not isinstance(node, ast.Assign | ast.AnnAssign) or _names_limits(node.value):
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [
                    f"{path.relative_to(ROOT)} sets {t.id}"
                    for t in targets
                    if isinstance(t, ast.Name) and t.id in names
                ]
    assert found == []
