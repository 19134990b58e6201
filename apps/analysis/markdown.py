"""The one layout of an analysis's Markdown page, so every page reads alike and names its producer."""

from __future__ import annotations


def markdown_page(
    title: str, intro: str | None, table: list[str], note: str, fingerprint: str, see: str
) -> str:
    """`# title`, an optional intro paragraph, the table's lines, a note, then the fingerprint
    line pointing at `see` (where the full producer record is)."""
    lines = [f"# {title}", ""]
    if intro is not None:
        lines += [intro, ""]
    lines += [*table, "", note, "", f"Fingerprint `{fingerprint}` (see {see}).", ""]
    return "\n".join(lines)
