"""Listings as an aligned table, JSON, JSON lines or CSV (``-o table|json|jsonl|csv``)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from typing import Any

FORMATS = ("table", "json", "csv")
LISTING_FORMATS = ("table", "json", "jsonl", "csv")  # a row per line suits long listings


def render(rows: Sequence[dict[str, Any]], columns: Sequence[str], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(list(rows), indent=2, sort_keys=False)
    if fmt == "jsonl":
        return "\n".join(json.dumps(row) for row in rows)
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(
            buffer, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n"
        )
        writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue().rstrip("\n")
    return table(rows, columns)


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    header = [c.upper().replace("_", " ") for c in columns]
    widths = [max(len(x) for x in column) for column in zip(header, *cells, strict=False)]
    lines = [
        "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=False)).rstrip()
        for line in [header, *cells]
    ]
    return "\n".join(lines)
