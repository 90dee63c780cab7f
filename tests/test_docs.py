"""The documents say what the code does: docs/operations.md's Limits table states every bound of
gdn_server.limits with its default, and docs/README.md lists every page in docs/."""
from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

from gdn_server import limits
from gdn_server.cli import build_parser
from gdn_server.config import PRESETS, ModelShape

DOCS = Path(__file__).resolve().parent.parent / "docs"
UNITS = {None: 1, "s": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def limits_table() -> list[tuple[str, list[str], str]]:
    """(bound, names in backticks, default) for each row of operations.md's Limits table."""
    text = (DOCS / "operations.md").read_text()
    section = text.split("\n## Limits", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "bound":
            continue
        assert len(cells) == 4, line
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1]), cells[2]))
    assert len(rows) >= 10, "the Limits table was not found"
    return rows


def stated_default(cell: str) -> float | None:
    """The value a default cell begins with: a number with an optional unit, or `none`."""
    if cell.startswith("none"):
        return None
    m = re.match(r"(\d+(?:\.\d+)?)(?: (KiB|MiB|GiB|s)\b)?", cell)
    assert m, f"a default begins with a number (and unit) or 'none': {cell!r}"
    return float(m[1]) * UNITS[m[2]]


def code_default(name: str) -> object:
    """A name of gdn_server.limits (`Limits.max_calls`, `MAX_CHUNK_BYTES`) resolved to its value."""
    owner, _, attr = name.rpartition(".")
    holder = getattr(limits, owner) if owner else limits
    assert hasattr(holder, attr), f"{name} is not in gdn_server.limits"
    return getattr(holder, attr)


def module_limits() -> set[str]:
    """Every bound gdn_server.limits defines, named as the table names them."""
    names = set()
    for name, obj in vars(limits).items():
        if name.isupper():
            names.add(name)
        elif inspect.isclass(obj) and obj.__module__ == limits.__name__:
            names.update(f"{name}.{f.name}" for f in dataclasses.fields(obj))
        elif inspect.isfunction(obj) and obj.__module__ == limits.__name__:
            names.add(f"{name}()")
    return names


def test_every_default_in_the_table_is_the_code_s():
    parser = build_parser()
    for bound, names, default in limits_table():
        assert names, f"row {bound!r} names no flag or constant"
        if any(name.endswith("()") for name in names):
            continue  # a computed bound: test_message_bound_is_the_formula_stated
        for name in names:
            if name.startswith("--"):
                value = parser.get_default(name[2:].replace("-", "_"))
            else:
                value = code_default(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert stated_default(default) == value, f"{bound}: the table says {default!r}, {name} is {value}"
            else:
                assert value is None and stated_default(default) is None, (bound, name, value)


def test_every_limit_of_the_module_is_in_the_table():
    named = {n for _, names, _ in limits_table() for n in names if not n.startswith("--")}
    missing = module_limits() - named
    assert not missing, f"gdn_server.limits bounds missing from docs/operations.md's Limits table: {missing}"


def test_message_bound_is_the_formula_stated():
    (default,) = [d for _, names, d in limits_table() if "max_message_bytes()" in names]
    m = re.search(r"max\(`--max-batch-rows`, (\d+)\) rows of float32 inputs at T = (\d+), plus (\d+) (MiB)", default)
    assert m, default
    min_rows, tokens, room = int(m[1]), int(m[2]), int(m[3]) * UNITS[m[4]]
    assert (min_rows, room) == (limits.MESSAGE_MIN_ROWS, limits.MESSAGE_ROOM_BYTES)
    assert tokens == ModelShape.max_speculative_tokens
    s = PRESETS["qwen3-next"]
    token_bytes = 4 * (2 * s.num_q_heads * s.head_dim_k + s.num_v_heads * s.head_dim_v + 2 * s.num_v_heads)
    for batch_rows in (1, 256, 1024):
        expected = token_bytes * tokens * max(batch_rows, min_rows) + room
        assert limits.max_message_bytes(s, batch_rows) == expected


def test_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+\.md)\)", index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages <= linked, f"docs/README.md does not list {sorted(pages - linked)}"
    assert all((DOCS / page).is_file() for page in linked if "/" not in page), "docs/README.md links a missing page"
