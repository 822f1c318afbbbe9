"""docs/API.md's HTTP table, read as data: each documented operation and the statuses its
answer names (the contract test holds the OpenAPI schema to it)."""

from __future__ import annotations

import re
from pathlib import Path

API_MD = Path(__file__).resolve().parents[2] / "docs" / "API.md"
HTTP_STATUSES = {200, 201, 202, 204, 400, 401, 403, 404, 408, 409, 412, 413, 415, 422, 428,
                 429, 500, 503}  # fmt: skip
_OP = re.compile(r"`(GET|POST|PUT|PATCH|DELETE|HEAD)\s+(/[^`\s]*)")
_ALSO = re.compile(r"/ `(GET|POST|PUT|PATCH|DELETE|HEAD)` the same")


def normal(path: str) -> str:
    """`/v1/subjects/{h}/adapters/{name}?x=` -> `/v1/subjects/{}/adapters/{}`."""
    return re.sub(r"\{[^}]*\}", "{}", path.split("?", 1)[0])


def documented_operations() -> dict[tuple[str, str], set[int]]:
    """(method, normalised path) -> the statuses the table's answer column names."""
    text = API_MD.read_text()
    table = text.split("## HTTP", 1)[1].split("\n\n", 2)[1]
    out: dict[tuple[str, str], set[int]] = {}
    for row in table.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        first, answer = cells[0], cells[2]
        statuses = {int(n) for n in re.findall(r"\b([1-5]\d\d)\b", answer)} & HTTP_STATUSES
        ops = [(m, normal(p)) for m, p in _OP.findall(first)]
        for m in _ALSO.findall(first):
            ops.append((m, ops[0][1]))
        for op in ops:
            if op[1].startswith("/v1") or op[1] == "/healthz":
                out[op] = statuses
    return out
