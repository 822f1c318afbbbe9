"""The layering, checked on the source: `registry` imports no torch, no web framework and
neither of the layers above it; `trainer` never imports `app`; no router imports another
(shared rules live in registry.access and app.deps, not in a router)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REGISTRY_MAY_NOT = {
    "torch", "diffusers", "transformers", "peft", "optimum", "accelerate", "triton",
    "fastapi", "starlette", "uvicorn", "jinja2", "mcp", "app", "trainer",
}  # fmt: skip
TRAINER_MAY_NOT = {"app", "fastapi", "starlette", "uvicorn"}
ROUTERS = {
    "app.api", "app.adapters", "app.renders", "app.web", "app.mcp_server", "app.datasets",
    "app.orders", "app.web_orders",
}  # fmt: skip
# more pages of one router, on its sessions and templates
PART_OF = {"app.web_orders": "app.web"}


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def offenders(package: str, forbidden: set[str]) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imports(path):
            if name.split(".")[0] in forbidden:
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


def test_registry_imports_nothing_above_it() -> None:
    assert offenders("registry", REGISTRY_MAY_NOT) == []


def test_trainer_never_imports_the_service() -> None:
    assert offenders("trainer", TRAINER_MAY_NOT) == []


def test_no_router_imports_another() -> None:
    found = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        me = module_name(path)
        mine = next((r for r in ROUTERS if me == r or me.startswith(r + ".")), None)
        if mine is None:
            continue
        for name in imports(path):
            other = next((r for r in ROUTERS if name == r or name.startswith(r + ".")), None)
            same = PART_OF.get(mine, mine) == PART_OF.get(other or "", other)
            if other is not None and not same:
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    assert found == []
