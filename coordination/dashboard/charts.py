"""Charts drawn on the server as inline SVG: no script library, nothing fetched from elsewhere."""

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from coordination.dashboard.selectors import Series

WIDTH, HEIGHT = 600, 160
LEFT, BOTTOM, TOP = 44, 20, 8


def _nice_ceiling(value: float) -> float:
    """Return a round number at or above ``value`` for the y axis (1, 2, 5 × 10^n)."""
    if value <= 0:
        return 1.0
    magnitude = 1.0
    while magnitude * 10 <= value:
        magnitude *= 10
    while magnitude > value:
        magnitude /= 10
    for step in (1, 2, 5, 10):
        if step * magnitude >= value:
            return step * magnitude
    return 10 * magnitude


def _number(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.0f}"


def stacked_bars(series: Series, *, colors: dict[str, str], title: str, unit: str, caption: str) -> SafeString:
    """Return an SVG of one stacked bar per minute, with a legend and the y axis' top value."""
    names = list(series.values)
    count = len(series.starts)
    totals = [sum(series.values[name][i] for name in names) for i in range(count)]
    top = _nice_ceiling(max(totals, default=0))
    plot_w, plot_h = WIDTH - LEFT - 4, HEIGHT - BOTTOM - TOP
    slot = plot_w / max(count, 1)
    bars = []
    for i, start in enumerate(series.starts):
        y = TOP + plot_h
        for name in names:
            value = series.values[name][i]
            if value <= 0:
                continue
            height = value / top * plot_h
            y -= height
            bars.append(
                (
                    f"{LEFT + i * slot + 0.5:.1f}",
                    f"{y:.1f}",
                    f"{max(slot - 1, 1):.1f}",
                    f"{height:.1f}",
                    colors.get(name, "#888"),
                    f"{start:%H:%M} {name}: {_number(value)} {unit}",
                )
            )
    rects = format_html_join(
        "",
        '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}</title></rect>',
        bars,
    )
    legend = format_html_join(
        "",
        '<tspan fill="{}">■</tspan><tspan dx="2" dy="0">{} </tspan>',
        ((colors.get(name, "#888"), name) for name in names),
    )
    first = f"{series.starts[0]:%H:%M}" if series.starts else ""
    last = f"{series.starts[-1]:%H:%M}" if series.starts else ""
    return format_html(
        '<svg class="rs-chart" viewBox="0 0 {w} {h}" width="100%" role="img" aria-label="{title}" '
        'xmlns="http://www.w3.org/2000/svg">'
        '<line x1="{left}" y1="{top}" x2="{left}" y2="{base}" stroke="#999"/>'
        '<line x1="{left}" y1="{base}" x2="{right}" y2="{base}" stroke="#999"/>'
        '<text x="{tx}" y="{ty}" text-anchor="end" font-size="10">{ymax}</text>'
        '<text x="{tx}" y="{base}" text-anchor="end" font-size="10">0</text>'
        '<text x="{left}" y="{h}" font-size="10" dy="-4">{first}</text>'
        '<text x="{right}" y="{h}" font-size="10" dy="-4" text-anchor="end">{last} UTC</text>'
        '<text x="{legend_x}" y="{ty}" font-size="10" text-anchor="end">{legend}</text>'
        "{rects}</svg>"
        '<p class="rs-chart-caption">{caption} (axis: 0 to {ymax} {unit})</p>',
        w=WIDTH,
        h=HEIGHT,
        title=title,
        left=LEFT,
        top=TOP,
        base=TOP + plot_h,
        right=WIDTH - 4,
        tx=LEFT - 4,
        ty=TOP + 8,
        ymax=_number(top),
        first=first,
        last=last,
        legend_x=WIDTH - 4,
        legend=legend,
        rects=rects,
        caption=caption,
        unit=unit,
    )
