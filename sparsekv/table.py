"""Plain-text tables for the command line (demo, bench, report)."""

from __future__ import annotations


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table of `rows`; `columns` are `(header, key, format spec)`. Numbers are right-aligned."""
    cells = [[format(row[key], spec) if row[key] is not None else "-" for _, key, spec in columns] for row in rows]
    numeric = [all(isinstance(row[key], (int, float, type(None))) for row in rows) for _, key, _ in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(columns)]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    header = line([h for h, _, _ in columns])
    return "\n".join([header, "-" * len(header), *(line(c) for c in cells)])
