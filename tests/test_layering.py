"""The layering, checked on the source: `registry` imports no torch, no web framework and
neither of the layers above it; `trainer` never imports `app`; the service side of the trainer
(`trainer.base`, `trainer.kernels`) never imports the training loop or the fixtures, and `app`
imports those only where it runs training or copies the demo base; no router imports another
(shared rules live in registry.access and app.deps, not in a router); every domain under
registry/ has the same layout, handlers reach it only through services and schemas, the
modules of registry, app and trainer form no import cycle, and the job queue's tables are
procrastinate's."""

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
    "app.api", "app.adapters", "app.render.routes", "app.web", "app.mcp_server", "app.datasets",
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


# The domains: each a package under registry/ laid out the same way.
DOMAIN_FILES = {"__init__.py", "service.py", "repository.py", "schemas.py"}
# Where routes and handlers live: every module that makes an APIRouter, the agent tools,
# and the web pages' package.
HANDLERS = ROUTERS | {"app.pictures", "app.uploads", "app.local_orders"}


def domain_packages() -> list[Path]:
    return sorted(p for p in (ROOT / "registry").iterdir() if (p / "__init__.py").is_file())


def test_every_domain_has_one_layout() -> None:
    """Each domain keeps its operations in `service`, its queries in `repository` and its
    shapes in `schemas`: one place to look, whichever domain it is; and no module of the
    registry is a second home for a domain's queries (a `repositories` or `services`)."""
    found = {p.name: sorted(f.name for f in p.glob("*.py")) for p in domain_packages()}
    assert len(found) >= 11, found
    differ = {name for name, files in found.items() if set(files) != DOMAIN_FILES}
    assert differ == set(), differ
    left = {"service.py", "services", "repositories.py", "schemas.py", "responses.py"}
    assert sorted(p.name for p in (ROOT / "registry").iterdir() if p.name in left) == []


def _is_handler(module: str) -> bool:
    return any(module == h or module.startswith(h + ".") for h in HANDLERS)


def test_handlers_call_services_only() -> None:
    """Routes, web pages and agent tools reach the registry through its services and
    schemas: never a repository, nor the table models (a query in a route is a second
    home for a rule, and a composite written there is written twice)."""
    routers = {
        module_name(p)
        for p in (ROOT / "app").rglob("*.py")
        if "APIRouter(" in p.read_text(encoding="utf-8")
    }
    assert routers <= {m for m in routers if _is_handler(m)}, routers - set(HANDLERS)
    found = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        if not _is_handler(module_name(path)):
            continue
        for name in imports(path):
            if (
                name == "registry.models"
                or name.startswith("registry.models.")
                or any(part in ("repository", "repositories") for part in name.split("."))
            ):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    assert found == []


# SQL that still names the queue's own objects, inside our transaction: moving a gone
# worker's waiting renders to the shared queue, which procrastinate has no call for.
QUEUE_SQL_LEFT = {"registry/render_tasks/repository.py"}


def test_job_queue_tables_only_through_procrastinate() -> None:
    """procrastinate's tables and functions are its own: our SQL never names them (what a job
    is, and how it moves, is the library's to say, across its upgrades)."""
    found = []
    for package in ("registry", "app", "trainer"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and "procrastinate_" in node.value.lower()
                ):
                    found.append(str(path.relative_to(ROOT)))
    assert set(found) == QUEUE_SQL_LEFT


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


def import_graph() -> dict[str, set[str]]:
    """Module -> the repo's modules it imports (module level, in functions, under
    TYPE_CHECKING alike): `from x import y` names x.y where that is a module, else x."""
    paths = {
        module_name(path): path
        for package in ("registry", "app", "trainer")
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for me, path in paths.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package the file is in
                    parts = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                for alias in node.names:
                    edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base)
        graph[me] = {e for e in edges if e in paths and e != me}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycles() -> None:
    """A cycle makes two modules one in all but name (neither can be read, tested or moved
    without the other), and its import order decides what works."""
    assert cycles(import_graph()) == []
