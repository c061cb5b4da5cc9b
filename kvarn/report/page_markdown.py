"""Markdown as the page's HTML: CommonMark with tables, raw HTML off (every name and number from
the results escaped), headings shifted under the page's one h1; and the page's ids (`slug`)."""

from __future__ import annotations

import re


def markdown_parser():
    """markdown-it-py's CommonMark with tables and raw HTML off (escaped)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False}).enable("table")


def shift_headings(tokens, shift: int) -> None:
    """Headings `shift` levels down (the page's own title is the one h1)."""
    for t in tokens:
        if t.type in ("heading_open", "heading_close"):
            t.tag = f"h{min(6, int(t.tag[1]) + shift)}"


def _classify_tables(tokens, cls: str) -> None:
    for t in tokens:
        if t.type == "table_open" and not t.attrGet("class"):
            t.attrSet("class", cls)


def markdown_html(text: str, shift: int = 0, table_class: str | None = None) -> str:
    """`text` (CommonMark with tables, raw HTML escaped) as HTML, headings `shift` levels down."""
    md = markdown_parser()
    tokens = md.parse(text)
    shift_headings(tokens, shift)
    if table_class:
        _classify_tables(tokens, table_class)
    return md.renderer.render(tokens, md.options, {})


def inline_html(text: str) -> str:
    """One paragraph of inline Markdown as HTML without the <p>."""
    md = markdown_parser()
    return md.renderInline(text)


def slug(text: str) -> str:
    """An HTML id from a model or figure name (letters, digits, `.`, `_`, `-`)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")
