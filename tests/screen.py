"""What a Textual app draws: the screen's rendered lines, as text and as styled
segments, cropped to one widget's region, and the text of an exported SVG.

Tests of the chat read these, never the app's state: what counts is what a
user sees."""

from __future__ import annotations

import html
import re

from rich.segment import Segment


def _strips(app):
    # The compositor's full render of the current screen: what the terminal gets.
    return app.screen._compositor.render_strips()


def segments(app, selector: str) -> list[list[Segment]]:
    """The styled segments drawn in `selector`'s region, one list per row."""
    region = app.query_one(selector).region
    rows = _strips(app)[region.y:region.bottom]
    return [list(strip.crop(region.x, region.right)) for strip in rows]


def lines(app, selector: str = "#conversation") -> list[str]:
    """The text drawn in `selector`'s region, one string per row, right-stripped."""
    return ["".join(s.text for s in row).rstrip() for row in segments(app, selector)]


def left_of_stats(rows: list[str]) -> list[str]:
    """A whole screen's rows cut at the stats panel's border: the conversation's side."""
    return [row.split("│")[0] for row in rows]


def squeeze(text: str) -> str:
    """Text without whitespace: drawn text wraps and pads where the source did not."""
    return re.sub(r"\s+", "", text)


def shows(drawn: list[str], text: str) -> bool:
    """Every character of `text`, in order, is drawn (wrapping and padding aside)."""
    return squeeze(text) in squeeze("\n".join(drawn))


def shows_lines(drawn: list[str], text: str) -> list[str]:
    """The lines of `text` that no drawn row holds as they are (indentation
    included): empty when the drawing keeps every line."""
    return [line for line in text.splitlines() if line.strip() and not any(line.rstrip() in row for row in drawn)]


def svg_lines(svg: str) -> list[str]:
    """The rows of text of a screenshot that Textual exported as SVG: each run of
    text is placed at its column (runs of spaces are not written out)."""
    rows: dict[float, dict[int, str]] = {}
    runs = r'<text[^>]*\sx="([\d.]+)" y="([\d.]+)" textLength="([\d.]+)"[^>]*>([^<]*)</text>'
    for x, y, length, text in re.findall(runs, svg):
        text = html.unescape(text).replace("\xa0", " ").rstrip("\n")
        if text:
            rows.setdefault(float(y), {})[round(float(x) / (float(length) / len(text)))] = text
    out = []
    for _, row in sorted(rows.items()):
        line = ""
        for col, text in sorted(row.items()):
            line = line.ljust(col) + text
        out.append(line)
    return out


def lightness(segment: Segment) -> float:
    import colorsys

    return colorsys.rgb_to_hls(*(c / 255 for c in segment.style.color.get_truecolor()))[1]


def is_green(segment: Segment) -> bool:
    """Drawn in a saturated green (whatever shade the theme gives "green")."""
    import colorsys

    color = segment.style.color if segment.style else None
    if color is None:
        return False
    hue, lightness, saturation = colorsys.rgb_to_hls(*(c / 255 for c in color.get_truecolor()))
    return 70 <= hue * 360 <= 170 and saturation > 0.4 and lightness > 0.2
