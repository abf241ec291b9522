"""What a benchmark writes: Markdown tables for the record and ``--json`` figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """Return a Markdown table (readable as plain text too)."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(header), "| " + " | ".join("-" * w for w in widths) + " |", *(line(r) for r in rows)])


def write_json(path: str | Path, figures: dict[str, Any]) -> None:
    """Write ``figures`` to ``path`` (indented, keys in the order given), its folder made when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2) + "\n")
