"""Bench output: a Markdown table on stdout, plus ``<name>.json``, ``<name>.md`` and ``<name>.png`` in the out dir.

Every bench builds a :class:`Report` (title, header notes, one or more tables, the raw result dict) and
calls :func:`emit`, optionally with a ``plot(fig_or_axes, result)`` callback. Plots use matplotlib's
Agg backend (no display needed) and are kept small (they are committed under ``bench/``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def fmt(v: Any, digits: int = 1) -> str:
    """Table cell text: floats rounded, None/NaN as '-', everything else str()."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return "-"
        if v != 0 and abs(v) < 10 ** -digits:
            return f"{v:.{digits}g}"
        return f"{v:,.{digits}f}"
    return str(v)


def md_table(columns: list[str], rows: list[list[Any]], digits: int = 1) -> str:
    """GitHub Markdown table; numeric columns are right-aligned."""
    cells = [[fmt(c, digits) for c in r] for r in rows]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) if rows else False
               for i in range(len(columns))]
    widths = [max([len(columns[i])] + [len(r[i]) for r in cells]) for i in range(len(columns))]
    head = "| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |"
    sep = "|" + "|".join(("-" * (w + 1) + ":") if n else (":" + "-" * (w + 1)) for w, n in zip(widths, numeric)) + "|"
    body = ["| " + " | ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(r, widths, numeric)) + " |"
            for r in cells]
    return "\n".join([head, sep, *body])


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Any]]
    title: str | None = None
    digits: int = 1

    def to_markdown(self) -> str:
        out = f"**{self.title}**\n\n" if self.title else ""
        return out + md_table(self.columns, self.rows, self.digits)

    def to_json(self) -> dict:
        return {"title": self.title, "columns": self.columns, "rows": self.rows}


@dataclass
class Report:
    name: str
    title: str
    notes: list[str] = field(default_factory=list)  # header lines: workload size, scale-downs, skipped baselines
    tables: list[Table] = field(default_factory=list)
    result: dict = field(default_factory=dict)  # raw numbers (goes into the JSON)
    markdown: str | None = None  # preformatted body (for benches that render their own, e.g. alloc)

    def to_markdown(self) -> str:
        parts = [f"### {self.title}", ""]
        parts += [f"> {n}" for n in self.notes]
        if self.notes:
            parts.append("")
        for t in self.tables:
            parts += [t.to_markdown(), ""]
        if self.markdown:
            parts += [self.markdown.rstrip(), ""]
        return "\n".join(parts)


def environment(dtype: str | None = None) -> dict:
    """Where the numbers came from (goes into every JSON and the README header)."""
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": dtype,
        "loadavg_1m": load,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": _command(),
    }


def _command() -> str | None:
    """The bench command line as typed (``pagedllm bench ...`` or ``python -m pagedllm.bench.cli ...``)."""
    if not sys.argv or "pytest" in sys.argv[0]:
        return None
    args = sys.argv[1:]
    if args[:1] == ["bench"]:
        args = args[1:]
    return "pagedllm bench " + " ".join(args)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "__dict__"):
        return o.__dict__
    return str(o)


def _generic_plot(fig, result: dict, title: str) -> None:
    """Best effort for results we do not know the shape of: the first {series: {x: y}} mapping as lines,
    else the first {label: number} mapping as bars, else a note."""
    ax = fig.add_subplot(111)

    def series_map(d):
        if not isinstance(d, dict) or not d:
            return None
        if all(isinstance(v, dict) and v and all(isinstance(y, (int, float)) for y in v.values()) for v in d.values()):
            return d
        return None

    def walk(d, depth=0):
        if depth > 3 or not isinstance(d, dict):
            return None, None
        for k, v in d.items():
            s = series_map(v)
            if s:
                return k, s
        for k, v in d.items():
            r = walk(v, depth + 1)
            if r[0]:
                return r
        return None, None

    key, s = walk(result)
    if s:
        for name, pts in s.items():
            xs = list(pts.keys())
            try:
                xv = [float(x) for x in xs]
                order = sorted(range(len(xv)), key=lambda i: xv[i])
                ax.plot([xv[i] for i in order], [pts[xs[i]] for i in order], marker="o", label=str(name))
            except (TypeError, ValueError):
                ax.plot(range(len(xs)), list(pts.values()), marker="o", label=str(name))
                ax.set_xticks(range(len(xs)), [str(x) for x in xs], rotation=30, fontsize=7)
        ax.set_ylabel(str(key))
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no plottable series", ha="center", va="center")
        ax.set_axis_off()
    ax.set_title(title, fontsize=9)


def emit(report: Report, out_dir: str | os.PathLike, plot: Callable | None = None, dtype: str | None = None,
         quiet: bool = False) -> dict[str, str]:
    """Print the Markdown, write md/json/png into ``out_dir``; returns the written paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = report.to_markdown()
    if not quiet:
        print("\n" + md, flush=True)
    paths = {"md": str(out / f"{report.name}.md"), "json": str(out / f"{report.name}.json"),
             "png": str(out / f"{report.name}.png")}
    Path(paths["md"]).write_text(md)
    payload = {"name": report.name, "title": report.title, "notes": report.notes,
               "tables": [t.to_json() for t in report.tables], "result": report.result,
               "environment": environment(dtype)}
    Path(paths["json"]).write_text(json.dumps(payload, indent=1, default=_json_default))

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(7.5, 4.2), dpi=90)
    try:
        if plot is not None:
            plot(fig, report.result)
        else:
            _generic_plot(fig, report.result, report.title)
        fig.tight_layout()
    except Exception as e:  # a plot bug must not lose the numbers
        fig.clf()
        fig.text(0.5, 0.5, f"plot failed: {e!r}"[:200], ha="center", va="center", fontsize=8)
    fig.savefig(paths["png"])
    plt.close(fig)
    return paths
