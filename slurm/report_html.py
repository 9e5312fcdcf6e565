"""HTML pieces of the study report: escaped tables, sections, and matplotlib figures embedded
as base64 PNGs, so that the report is one self-contained file."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Iterable, Sequence

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f2f2f2; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.bad { color: #a00; font-weight: bold; } .best { background: #e8f5e9; }
pre { background: #f7f7f7; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
img { max-width: 100%; } figure { margin: 0.5em 0 1.5em; }
"""


def esc(value: object) -> str:
    return html.escape(str(value))


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def column(values: Sequence[float | None], digits: int = 4, suffix: str = "") -> list[str]:
    """One number format for a whole table column: fixed-point with the decimals that give
    the smallest value `digits` significant digits (up to 6), or scientific for every cell
    when the values reach 1e6 or go below 1e-3; an em dash for None or nan."""
    present = [abs(v) for v in values if _finite(v)]
    nonzero = [v for v in present if v > 0]
    if not nonzero:
        return [f"{v:.0f}{suffix}" if _finite(v) else "—" for v in values]
    if max(nonzero) >= 1e6 or min(nonzero) < 1e-3:
        spec = f".{digits - 1}e"
    else:
        spec = f".{min(6, max(0, digits - 1 - math.floor(math.log10(min(nonzero)))))}f"
    return [f"{v:{spec}}{suffix}" if _finite(v) else "—" for v in values]


def sizes(values: Sequence[float | None]) -> list[str]:
    """Byte counts in one unit for the whole column (that of the smallest), 3 digits."""
    present = [v for v in values if _finite(v) and v > 0]
    unit, scale = "B", 1
    for name, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if present and min(present) >= factor:
            unit, scale = name, factor
            break
    return column([v / scale if _finite(v) else None for v in values], 3, f" {unit}")


def table(header: Sequence[str], rows: Iterable[Sequence[object]],
          numeric: Iterable[int] = (), marked: Iterable[int] = ()) -> str:
    """An HTML table; cells are escaped unless they are Raw; `numeric` columns right-aligned,
    `marked` rows highlighted."""
    numeric, marked = set(numeric), set(marked)
    right, best = ' class="num"', ' class="best"'
    lines = ["<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>"]
    for index, row in enumerate(rows):
        cells = "".join(
            f"<td{right if i in numeric else ''}>"
            f"{cell if isinstance(cell, Raw) else esc(cell)}</td>" for i, cell in enumerate(row))
        lines.append(f"<tr{best if index in marked else ''}>{cells}</tr>")
    return "\n".join(lines + ["</table>"])


class Raw(str):
    """HTML that a table cell takes as is."""


def section(title: str, *parts: str) -> str:
    anchor = "".join(c if c.isalnum() else "-" for c in title.lower())
    return f'<h2 id="{anchor}">{esc(title)}</h2>\n' + "\n".join(p for p in parts if p)


def paragraph(text: str) -> str:
    return f"<p>{esc(text)}</p>"


def png_tag(data: bytes, alt: str, caption: str | None = None) -> str:
    """An <img> holding the PNG `data` inline (base64)."""
    encoded = base64.b64encode(data).decode("ascii")
    image = f'<img alt="{esc(alt)}" src="data:image/png;base64,{encoded}">'
    if caption:
        return f"<figure>{image}<figcaption>{esc(caption)}</figcaption></figure>"
    return image


def figure(width: float = 7, height: float = 4):
    """A matplotlib Figure on an Agg canvas (no display) and its axes."""
    # deferred: pulls in matplotlib (slow to start, or optional)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def png_of(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def page(title: str, body: list[str]) -> str:
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
            f"<style>{STYLE}</style></head><body>\n<h1>{esc(title)}</h1>\n"
            + "\n".join(body) + "\n</body></html>\n")
