"""Sections as HTML: the static page of `kvtune report` (index.html and one PNG per figure)
and the notebook's display (`show`)."""
from __future__ import annotations

import html
import math
import os
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from ..config import ConfigError
from ..log import get_logger
from .data import Results, load_results, storage_name
from .sections import Section, build_sections


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def table_html(df: pd.DataFrame) -> str:
    if df is None or df.empty:
        return "<p><em>(empty)</em></p>"
    return df.to_html(index=False, na_rep="", float_format=_fmt, classes="kv", border=0, escape=True)


def section_html(sec: Section, img_src: str | None = None, part: str = "all") -> str:
    """The section's HTML. Used by both the static page and the notebook, so both show the
    same text and tables. part: 'all'; 'head' (title and notes) or 'body' (tables and the
    YAML), between which the notebook shows the figure inline; img_src: the figure's PNG."""
    parts = []
    if part in ("all", "head"):
        parts.append(f'<h2 id="{sec.key}">{html.escape(sec.title)}</h2>')
        parts += [f"<p>{html.escape(n)}</p>" for n in sec.notes]
    if img_src and part == "all":
        parts.append(f'<img src="{html.escape(img_src)}" alt="{html.escape(sec.title)}">')
    if part in ("all", "body"):
        tables = list(sec.tables)
        if sec.code is not None:  # the YAML beside the table it came from
            first = tables.pop(0) if tables else None
            side = f"<h4>{html.escape(first[0])}</h4>{table_html(first[1])}" if first else ""
            parts.append('<div class="side"><div class="code"><h4>exported YAML</h4><pre>'
                         f'{html.escape(sec.code)}</pre></div><div class="tab">{side}</div></div>')
        for cap, df in tables:
            parts.append(f"<h4>{html.escape(cap)}</h4>{table_html(df)}")
    return "\n".join(parts)


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1400px; }
table.kv { border-collapse: collapse; font-size: 12px; margin-bottom: 1em; }
table.kv th, table.kv td { padding: 2px 8px; border-bottom: 1px solid #ddd; text-align: right; }
table.kv th { background: #f3f3f3; }
img { max-width: 100%; border: 1px solid #eee; }
.side { display: flex; gap: 2em; align-items: flex-start; }
.side .code { flex: 0 0 auto; max-width: 45%; }
.side .tab { flex: 1 1 auto; overflow-x: auto; }
pre { background: #f7f7f7; padding: 0.8em; font-size: 11px; overflow-x: auto; }
.warn { background: #fff3cd; padding: 0.5em 1em; }
"""
NOTEBOOK_CSS = ".side { display: flex; gap: 2em; align-items: flex-start; } .side pre { font-size: 11px; }"


def header_html(res: Results) -> str:
    warn = (f'<p class="warn">{html.escape(res.timing_label)}.</p>' if res.is_cpu else
            f"<p>Timings: {html.escape(res.timing_label)}.</p>")
    return (f"<h1>kvtune review: {html.escape(res.deployment)}</h1>"
            f"<p>Results folder: <code>{html.escape(str(res.folder))}</code>; {len(res.trials)} trial rows; "
            f"backends: {html.escape(', '.join(res.backends))}; study storage: "
            f"{html.escape(storage_name(res)) if res.storage else 'none'}; exported YAML: "
            f"{html.escape(res.tuned_path.name) if res.tuned_path else 'none'}.</p>{warn}")


def show(sec: Section) -> None:
    """Display a section in a notebook: the report's HTML, the figure inline between."""
    from IPython.display import HTML, display
    display(HTML(section_html(sec, part="head")))
    if sec.figure is not None:
        display(sec.figure)
        plt.close(sec.figure)  # displayed once, not again by the inline backend at cell end
    body = section_html(sec, part="body")
    if body:
        display(HTML(f"<style>{NOTEBOOK_CSS}</style>{body}"))


def write_report(target: str | os.PathLike, out: str | os.PathLike | None = None, dpi: int = 110,
                 storage: str | None = None) -> Path:
    """Write `index.html` and one PNG per figure into `out` (default: <results>/report/)."""
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out}: a file, not a folder; the report is a folder (index.html and its figures)")
    res = load_results(target, storage)
    if res.tuned_error:   # the page shows it too, but nobody reads a page they were not told about
        get_logger(__name__).warning(f"{res.tuned_error}; the report shows the trials without the exported YAML")
    out = Path(out) if out is not None else res.folder / "report"
    out.mkdir(parents=True, exist_ok=True)
    body = [header_html(res), "<ul>"]
    secs = build_sections(res)
    body += [f'<li><a href="#{s.key}">{html.escape(s.title)}</a></li>' for s in secs] + ["</ul>"]
    for s in secs:
        img = None
        if s.figure is not None:
            img = f"{s.key}.png"
            s.figure.savefig(out / img, dpi=dpi, bbox_inches="tight")
            plt.close(s.figure)
        body.append(section_html(s, img))
    page = (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>kvtune review: "
            f"{html.escape(res.deployment)}</title><style>{CSS}</style></head><body>\n" + "\n".join(body)
            + "\n</body></html>\n")
    (out / "index.html").write_text(page)
    return out / "index.html"
