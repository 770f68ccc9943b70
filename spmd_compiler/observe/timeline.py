"""A timeline of one step as the program runs it: compute vs each collective, in schedule order.

Reads the lowered (eager) graph, the schedule every rank runs (the program is the same on every
rank; with ``SPMD_LOG_ALL_RANKS`` each rank writes its own), and draws, left to right in the
order the program runs its ops, one lane of compute (coloured by region: forward, backward,
optimizer) and one lane per collective from its issue to its wait. A collective's bar spans the
ops that run while it is in flight: its overlap with compute. The x axis counts ops, not
seconds: an op's duration is not known before it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from pathlib import Path

import torch.fx as fx

from spmd_compiler.passes.meta import REGION

from .visualize import _Sizer, collective_bytes, collective_kind, fmt_bytes, is_collective

_STEP, _LANE, _LEFT, _TOP = 6, 18, 190, 40  # px per op, px per lane, label column, title
_REGION_FILL = {"forward": "#9ecae1", "backward": "#fdae6b", "optimizer": "#bcbddc"}


@dataclass
class Span:
    lane: str  # "compute" or the collective's label
    start: int  # schedule position of its first op
    end: int  # one past its last op (a collective: its wait)
    region: str | None


def spans(gm: fx.GraphModule, sizer: _Sizer | None = None) -> list[Span]:
    """The compute runs (contiguous ops of one region) and each collective's issue-to-wait
    interval, in schedule positions of ``gm``'s nodes (placeholders and output excluded)."""
    sizer = sizer or _Sizer()
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    position = {n: i for i, n in enumerate(ops)}
    out: list[Span] = []
    region = None
    for i, n in enumerate(ops):
        r = n.meta.get(REGION)
        region = getattr(r, "value", r) or region
        if is_collective(n):
            wait = next((u for u in n.users if "wait_tensor" in str(u.target)), None)
            end = position.get(wait, i) + 1
            kind = collective_kind(n)
            if kind == "broadcast" and len(n.args) > 1 and isinstance(n.args[1], int):
                kind = f"broadcast from rank {n.args[1]}"  # gloo's all_gather, one per rank
            label = f"{kind} {fmt_bytes(collective_bytes(n, sizer)[0])}"
            out.append(Span(label, i, end, region))
        elif out and out[-1].lane == "compute" and out[-1].region == region and out[-1].end == i:
            out[-1].end = i + 1
        elif "wait_tensor" not in str(n.target):
            out.append(Span("compute", i, i + 1, region))
    return out


def timeline_svg(gm: fx.GraphModule, title: str = "", sizer: _Sizer | None = None) -> str:
    """The SVG text of the timeline of ``gm`` (see the module docstring)."""
    found = spans(gm, sizer)
    collectives = [s for s in found if s.lane != "compute"]
    n_ops = max((s.end for s in found), default=0)
    step = max(1, min(_STEP, 1600 // max(1, n_ops)))
    width = _LEFT + n_ops * step + 20
    height = _TOP + (len(collectives) + 2) * _LANE + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="Helvetica" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="8" y="18" font-size="14">{escape(title or "one step")}: compute vs each '
           f'collective, in the order the program runs its ops ({n_ops} ops)</text>']

    def bar(row: int, span: Span, fill: str, label: str) -> None:
        x, y = _LEFT + span.start * step, _TOP + row * _LANE
        w = max(step, (span.end - span.start) * step)
        out.append(f'<rect class="{"compute" if span.lane == "compute" else "collective"}" '
                   f'x="{x}" y="{y}" width="{w}" height="{_LANE - 4}" fill="{fill}" '
                   f'stroke="#525252" stroke-width="0.5"><title>{escape(label)}</title></rect>')

    out.append(f'<text x="8" y="{_TOP + _LANE - 7}">compute</text>')
    for span in found:
        if span.lane == "compute":
            bar(0, span, _REGION_FILL.get(span.region, "#d9d9d9"),
                f"{span.region or 'other'}: ops {span.start}-{span.end - 1}")
    for row, span in enumerate(collectives, start=1):
        out.append(f'<text x="8" y="{_TOP + row * _LANE + _LANE - 7}">{escape(span.lane)}</text>')
        bar(row, span, "#fc9272", f"{span.lane}: issued at op {span.start}, waited at op "
                                  f"{span.end - 1} ({span.end - span.start - 1} ops overlap it)")
    legend_y = _TOP + (len(collectives) + 1) * _LANE + 12
    x = 8
    for name, fill in [*_REGION_FILL.items(), ("collective in flight", "#fc9272")]:
        out.append(f'<rect x="{x}" y="{legend_y}" width="12" height="12" fill="{fill}"/>'
                   f'<text x="{x + 16}" y="{legend_y + 10}">{escape(name)}</text>')
        x += 16 + 8 * len(name) + 12
    out.append("</svg>")
    return "\n".join(out)


def write_timeline(gm: fx.GraphModule, folder: str | Path, title: str = "") -> Path:
    """Write ``timeline.svg`` of ``gm`` (a lowered graph) into ``folder``; return its path."""
    path = Path(folder) / "timeline.svg"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(timeline_svg(gm, title))
    return path
