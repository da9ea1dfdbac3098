"""`Document`: one report written twice, as self-contained HTML and as Markdown.

The HTML has its CSS inline and its figures as ``data:image/png;base64`` URIs: it opens offline,
from an e-mail attachment or a copied run dir, with no JavaScript and no CDN. The Markdown refers
to the same figures as files under ``<stem>_files/`` beside it. All text is escaped here, so
callers pass raw strings (messages, config values, error lines) and never markup.
"""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import Any

__all__ = ["CSS", "Document"]

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1100px;
color:#1d2329;background:#fff;line-height:1.4}
h1{font-size:1.6em;border-bottom:2px solid #2b6cb0;padding-bottom:4px}h2{font-size:1.25em;margin-top:1.6em;
color:#2b6cb0}h3{font-size:1.05em}table{border-collapse:collapse;margin:8px 0;font-size:.86em;width:100%}
th,td{border:1px solid #cfd6dd;padding:3px 6px;text-align:left;vertical-align:top}th{background:#edf2f7}
tr.mismatch td{background:#fde2e1}tr.error td:first-child{border-left:5px solid #c53030}
tr.warning td:first-child{border-left:5px solid #d69e2e}tr.info td:first-child{border-left:5px solid #3182ce}
.note{color:#5a6773;font-style:italic}.bad{color:#c53030;font-weight:bold}.ok{color:#2f855a;font-weight:bold}
pre{background:#f6f8fa;padding:8px;overflow:auto;font-size:.8em}code{background:#f1f3f5;padding:0 3px}
img{max-width:100%;border:1px solid #e2e8f0;margin:6px 0}details{margin:8px 0}summary{cursor:pointer}
"""
_FILES = "\x00files\x00"  # where the Markdown's figure folder goes; no escaped text can hold a NUL


def _md_cell(value: Any) -> str:
    return " ".join(str("" if value is None else value).split()).replace("|", "\\|")


class Document:
    def __init__(self, title: str) -> None:
        self.title = title
        self.html: list[str] = [f"<h1>{html.escape(title)}</h1>"]
        self.md: list[str] = [f"# {title}", ""]
        self.images: dict[str, bytes] = {}

    def heading(self, text: str, level: int = 2) -> None:
        self.html.append(f"<h{level}>{html.escape(text)}</h{level}>")
        self.md += ["#" * level + " " + text, ""]

    def para(self, text: str, css: str | None = None) -> None:
        cls = f' class="{css}"' if css else ""
        self.html.append(f"<p{cls}>{html.escape(text)}</p>")
        self.md += [f"_{text}_" if css == "note" else text, ""]

    def note(self, text: str) -> None:
        self.para(text, "note")

    def fields(self, pairs: list[tuple[str, Any]]) -> None:
        """A two-column key/value table; a value starting with '!' is shown as bad."""
        rows = []
        for key, value in pairs:
            text = str(value)
            bad = text.startswith("!")
            text = text[1:] if bad else text
            cell = f'<span class="bad">{html.escape(text)}</span>' if bad else html.escape(text)
            rows.append(f"<tr><th>{html.escape(key)}</th><td>{cell}</td></tr>")
        self.html.append("<table>" + "".join(rows) + "</table>")
        self.md += ["| | |", "|---|---|"] + [f"| {_md_cell(k)} | {_md_cell(str(v).lstrip('!'))} |" for k, v in pairs]
        self.md.append("")

    def table(self, headers: list[str], rows: list[list[Any]], row_classes: list[str] | None = None) -> None:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
        body = []
        for i, row in enumerate(rows):
            cls = row_classes[i] if row_classes and i < len(row_classes) and row_classes[i] else ""
            attr = f' class="{cls}"' if cls else ""
            body.append(f"<tr{attr}>" + "".join(f"<td>{html.escape(_text(c))}</td>" for c in row) + "</tr>")
        self.html.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")
        self.md += ["| " + " | ".join(_md_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
        for i, row in enumerate(rows):
            mark = "**≠** " if row_classes and i < len(row_classes) and row_classes[i] == "mismatch" else ""
            self.md.append("| " + mark + " | ".join(_md_cell(_text(c)) for c in row) + " |")
        self.md.append("")

    def image(self, name: str, title: str, png: bytes) -> None:
        data = base64.b64encode(png).decode("ascii")
        self.html.append(f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>')
        self.images[f"{name}.png"] = png
        self.md += [f"![{title}]({_FILES}/{name}.png)", ""]

    def svg(self, name: str, title: str, svg: str) -> None:
        """An SVG drawing: inline in the HTML, a file beside the Markdown."""
        self.html.append(f'<figure title="{html.escape(title)}" style="overflow-x:auto">{svg}</figure>')
        self.images[f"{name}.svg"] = svg.encode("utf-8")
        self.md += [f"![{title}]({_FILES}/{name}.svg)", ""]

    def details(self, summary: str, text: str) -> None:
        self.html.append(f"<details><summary>{html.escape(summary)}</summary><pre>{html.escape(text)}</pre></details>")
        self.md += ["<details><summary>" + html.escape(summary) + "</summary>", "", "```yaml", text.rstrip(),
                    "```", "", "</details>", ""]

    def fold(self, summary: str) -> None:
        """What follows, up to ``unfold()``, is collapsed under ``summary`` in the HTML (markdown: a bold line)."""
        self.html.append(f"<details><summary>{html.escape(summary)}</summary>")
        self.md += [f"**{summary}**", ""]

    def unfold(self) -> None:
        self.html.append("</details>")

    def pre(self, text: str) -> None:
        self.html.append(f"<pre>{html.escape(text)}</pre>")
        self.md += ["```", text.rstrip(), "```", ""]

    def write(self, out_dir: str | Path, stem: str) -> tuple[Path, Path]:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        files = f"{stem}_files"
        if self.images:
            (out_dir / files).mkdir(exist_ok=True)
            for name, png in self.images.items():
                _atomic_write(out_dir / files / name, png)
        page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{html.escape(self.title)}</title><style>{CSS}</style></head><body>\n"
                + "\n".join(self.html) + "\n</body></html>\n")
        md = "\n".join(line.replace(_FILES, files) for line in self.md) + "\n"
        html_path, md_path = out_dir / f"{stem}.html", out_dir / f"{stem}.md"
        _atomic_write(html_path, page.encode("utf-8"))
        _atomic_write(md_path, md.encode("utf-8"))
        return html_path, md_path


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _atomic_write(path: Path, data: bytes) -> None:
    """Readers (a browser refreshing, a second report) never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
