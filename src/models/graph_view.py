"""A view of the model: its module tree with parameter counts, trainable/frozen and ZeRO-3 partitioning.

``module_rows(net)`` walks ``named_modules`` -- no forward, so it works on the meta device (a 7B
config builds and renders in seconds with no weight allocated) and on a ZeRO-3-partitioned net
(``ds_numel``/``ds_shape`` hold the real sizes; each rank holds ``ds_tensor``, its 1/world share).
Repeated siblings with the same structure (decoder layers 3..29) are folded into one row ``x N``.
``render_svg(rows)`` draws the tree as an SVG of its own; ``render_markdown(rows)`` the same as a table.

Why not torchview / torchviz (the usual model-graph tools): both trace a forward (torchview) or a backward graph
(torchviz) and need Graphviz's ``dot`` binary, which the project's install does not bring. A forward on
the meta device fails for the DeepSeek MoE nets (routing reads data: ``Tensor.item() cannot be called
on meta tensors``, measured with transformers 5.23), so no forward-tracing library can draw a 7B
DeepSeek config without allocating it; the module tree is what stays cheap.

Colours: green = all trainable, grey = all frozen, amber = mixed; a dashed border = ZeRO-3 partitioned.
Runs on one rank; nothing here calls a collective.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from torch import nn

__all__ = ["ModuleRow", "module_rows", "render_svg", "render_markdown", "human"]


@dataclass
class ModuleRow:
    name: str                      # "model.layers.3" ("" = the root)
    type: str
    depth: int
    params: int                    # everything under it (real size under ZeRO-3)
    trainable: int
    own_shapes: list[str] = field(default_factory=list)  # its direct parameters: "weight [4096, 4096]"
    partitioned: int = 0           # parameters under it that ZeRO-3 partitioned
    local: int = 0                 # of those, the elements this rank holds
    repeat: int = 1                # folded identical siblings (this row stands for `repeat` modules)
    repeat_names: str = ""         # "model.layers.3 .. model.layers.29"

    @property
    def frozen(self) -> int:
        return self.params - self.trainable


def module_rows(net: nn.Module, max_depth: int = 5, fold_repeats: bool = True) -> list[ModuleRow]:
    """One row per module down to ``max_depth`` (the root is depth 0), in tree order, counts inclusive."""
    rows: list[ModuleRow] = []
    _walk(net, "", 0, max_depth, fold_repeats, rows)
    return rows


def _size(p: nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def _shape(p: nn.Parameter) -> list[int]:
    return list(getattr(p, "ds_shape", p.shape))


def _signature(module: nn.Module) -> tuple:
    """Same type, same parameter names/shapes/trainability all the way down: one row can stand for both."""
    return (type(module).__name__,
            tuple((n, tuple(_shape(p)), p.requires_grad) for n, p in module.named_parameters()))


def _row(module: nn.Module, name: str, depth: int) -> ModuleRow:
    params = list(module.parameters())
    part = [p for p in params if hasattr(p, "ds_tensor")]
    return ModuleRow(
        name=name, type=type(module).__name__, depth=depth,
        params=sum(_size(p) for p in params), trainable=sum(_size(p) for p in params if p.requires_grad),
        own_shapes=[f"{n} {_shape(p)}" + ("" if p.requires_grad else " frozen")
                    for n, p in module.named_parameters(recurse=False)],
        partitioned=sum(_size(p) for p in part), local=sum(p.ds_tensor.numel() for p in part),
    )


def _walk(module: nn.Module, name: str, depth: int, max_depth: int, fold: bool, rows: list[ModuleRow]) -> None:
    rows.append(_row(module, name, depth))
    if depth >= max_depth:
        return
    children = list(module.named_children())
    i = 0
    while i < len(children):
        child_name, child = children[i]
        full = f"{name}.{child_name}" if name else child_name
        j = i + 1
        if fold:
            sig = _signature(child)
            while j < len(children) and _signature(children[j][1]) == sig:
                j += 1
        start = len(rows)
        _walk(child, full, depth + 1, max_depth, fold, rows)
        if j - i > 1:  # the head row stands for every copy; the rows below it show one copy
            last = f"{name}.{children[j - 1][0]}" if name else children[j - 1][0]
            head = rows[start]
            head.repeat, head.repeat_names = j - i, f"{full} .. {last}"
            copies = [_row(m, "", 0) for _, m in children[i + 1:j]]
            head.params += sum(c.params for c in copies)
            head.trainable += sum(c.trainable for c in copies)
            head.partitioned += sum(c.partitioned for c in copies)
            head.local += sum(c.local for c in copies)
        i = j


def human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def _label(row: ModuleRow) -> str:
    name = row.repeat_names if row.repeat > 1 else (row.name or "(root)")
    text = f"{name}: {row.type}"
    if row.repeat > 1:
        text += f" x {row.repeat}"
    text += f"  {human(row.params)} params"
    if row.params and row.frozen:
        text += f" ({human(row.trainable)} trainable, {human(row.frozen)} frozen)"
    elif row.params and not row.trainable:
        text += " (frozen)"
    if row.partitioned:
        text += f"  ZeRO-3: this rank holds {human(row.local)} of {human(row.partitioned)}"
    return text


def render_markdown(rows: list[ModuleRow]) -> str:
    lines = ["| module | type | params | trainable | frozen | ZeRO-3 (held here / partitioned) | own parameters |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        name = "&nbsp;" * 2 * row.depth + (row.repeat_names if row.repeat > 1 else (row.name or "(root)"))
        kind = row.type + (f" x {row.repeat}" if row.repeat > 1 else "")
        zero = f"{human(row.local)} / {human(row.partitioned)}" if row.partitioned else ""
        lines.append(f"| {name} | {kind} | {human(row.params)} | {human(row.trainable)} | {human(row.frozen)} | "
                     f"{zero} | {'; '.join(row.own_shapes)} |")
    return "\n".join(lines) + "\n"


def render_svg(rows: list[ModuleRow], title: str = "model") -> str:
    """The tree as an indented list of boxes (one per row), coloured by trainability."""
    line_h, indent, char_w, pad = 22, 22, 7.2, 8
    texts = [_label(r) for r in rows]
    shapes = ["; ".join(r.own_shapes) for r in rows]
    width = int(max(r.depth * indent + max(len(t), len(s)) * char_w for r, t, s in zip(rows, texts, shapes)) + 4 * pad)
    heights = [line_h + (14 if s else 0) for s in shapes]
    height = sum(heights) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="12">',
           f'<text x="{pad}" y="18" font-weight="bold">{html.escape(title)}: {human(rows[0].params)} parameters, '
           f'{human(rows[0].trainable)} trainable, {human(rows[0].frozen)} frozen'
           + (f', ZeRO-3 partitioned (this rank holds {human(rows[0].local)})' if rows[0].partitioned else '')
           + '</text>']
    y = 30
    for row, text, shape, h in zip(rows, texts, shapes, heights):
        x = pad + row.depth * indent
        fill = "#d9f2d9" if row.frozen == 0 else "#e6e6e6" if row.trainable == 0 else "#fde9c4"
        dash = ' stroke-dasharray="4,2"' if row.partitioned else ""
        out.append(f'<rect x="{x}" y="{y}" width="{width - x - pad}" height="{h - 4}" rx="3" fill="{fill}" '
                   f'stroke="#555"{dash}/>')
        out.append(f'<text x="{x + 5}" y="{y + 14}">{html.escape(text)}</text>')
        if shape:
            out.append(f'<text x="{x + 5}" y="{y + 28}" fill="#444" font-size="10">{html.escape(shape)}</text>')
        y += h
    out.append("</svg>")
    return "\n".join(out) + "\n"
