"""The C++ reference from the public headers' own comments (no Doxygen): a Sphinx directive

    ```{cpp-header} posenc/rope.h
    ```

reads ``csrc/include/posenc/rope.h`` (``cpp_headers_root`` in conf.py) and renders it as a
section: the header's leading comment as text, then each top-level declaration (a function, a
struct or class with its body, an enum, a using or constexpr, a macro, an ``#if`` group) as a
C++ code block under the comment that precedes it. Comments that stand alone (a blank line
between them and the next code) are rendered as text. ``#include`` and ``#pragma`` lines and the
namespace braces are left out. The parser is a line scanner that counts braces outside
comments, strings and character literals; it needs nothing but the headers' usual layout
(one declaration after another, comments as ``//`` lines).

``parse_header(text)`` is the parser alone (tests/python/test_docs.py uses it).
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass, field
from typing import List, Optional

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

_NAMESPACE_OPEN = re.compile(r"^\s*(inline\s+)?namespace(\s+[\w:]+)?\s*\{\s*(//.*)?$")
_NAMESPACE_CLOSE = re.compile(r"^\s*\}\s*//\s*namespace\b.*$")
_TRANSPARENT = re.compile(r"^\s*(POSENC_ISA_NAMESPACE_BEGIN|POSENC_ISA_NAMESPACE_END)\s*$")
_SKIPPED_DIRECTIVE = re.compile(r"^\s*#\s*(include|pragma)\b")
# A macro invoked as a statement of its own (an X-macro list expanded: NAME(ARGS), no ';').
_MACRO_CALL = re.compile(r"^\s*[A-Z_][A-Z0-9_]*\(.*\)$")


@dataclass
class Entry:
    """One item of a header: ``comment`` (the text of its ``//`` lines) and ``code`` (the
    declaration, empty for a comment that stands alone)."""

    comment: str
    code: str = ""


@dataclass
class Header:
    leading: str
    entries: List[Entry] = field(default_factory=list)
    includes: List[str] = field(default_factory=list)  # the posenc headers it includes


def _code_part(line: str) -> str:
    """The line without its ``//`` or ``/* */`` comment and with strings blanked, for counting
    braces."""
    out = []
    i, n = 0, len(line)
    while i < n:
        c = line[i]
        if c in "\"'":
            j = i + 1
            while j < n and line[j] != c:
                j += 2 if line[j] == "\\" else 1
            out.append(c + " " * max(0, min(j, n) - i - 1) + c)
            i = j + 1
            continue
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            end = line.find("*/", i + 2)
            if end < 0:
                break
            i = end + 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("//")


def _comment_text(lines: List[str]) -> str:
    return "\n".join(re.sub(r"^\s*// ?", "", line) for line in lines)


def parse_header(text: str) -> Header:
    lines = text.splitlines()
    i = 0
    # The leading comment: the // lines before the first line of code.
    lead: List[str] = []
    while i < len(lines) and (_is_comment(lines[i]) or not lines[i].strip()):
        if _is_comment(lines[i]):
            lead.append(lines[i])
        elif lead:
            i += 1
            break
        i += 1
    header = Header(leading=_comment_text(lead))
    header.includes = re.findall(r'^\s*#\s*include\s+"(posenc/[^"]+)"', text, flags=re.M)

    pending: List[str] = []  # comment lines waiting for their declaration
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            if pending:
                header.entries.append(Entry(_comment_text(pending)))
                pending = []
            i += 1
            continue
        if _is_comment(line):
            pending.append(line)
            i += 1
            continue
        if (_NAMESPACE_OPEN.match(line) or _NAMESPACE_CLOSE.match(line) or _TRANSPARENT.match(line)
                or _SKIPPED_DIRECTIVE.match(line)):
            if pending:
                header.entries.append(Entry(_comment_text(pending)))
                pending = []
            i += 1
            continue
        code: List[str] = []
        if stripped.startswith("#"):
            # A preprocessor directive (with its continuation lines), or an #if group whole.
            conditional = re.match(r"#\s*if", stripped) is not None
            depth = 0
            while i < len(lines):
                current = lines[i]
                code.append(current)
                s = current.strip()
                if re.match(r"#\s*if", s):
                    depth += 1
                elif re.match(r"#\s*endif", s):
                    depth -= 1
                i += 1
                if current.rstrip().endswith("\\"):
                    continue
                if not conditional or depth <= 0:
                    break
        else:
            # A declaration: up to a ';' or a closing '}' with every brace and paren closed.
            depth = 0
            while i < len(lines):
                current = lines[i]
                code.append(current)
                part = _code_part(current)
                depth += part.count("{") + part.count("(") - part.count("}") - part.count(")")
                i += 1
                tail = part.rstrip()
                if depth <= 0 and (tail.endswith(";") or tail.endswith("}") or _MACRO_CALL.match(tail)):
                    break
        header.entries.append(Entry(_comment_text(pending), _dedent("\n".join(code))))
        pending = []
    if pending:
        header.entries.append(Entry(_comment_text(pending)))
    # A declaration without a comment of its own joins the code block before it.
    merged: List[Entry] = []
    for entry in header.entries:
        if merged and merged[-1].code and not entry.comment and entry.code:
            merged[-1].code += "\n" + entry.code
        else:
            merged.append(entry)
    header.entries = merged
    return header


def _dedent(code: str) -> str:
    import textwrap

    return textwrap.dedent(code).rstrip()


def _paragraphs(text: str) -> List[nodes.Node]:
    """Comment text as paragraphs (blank comment lines separate them); lines that are indented
    or look like a table or formula stay as they are, in a literal block."""
    out: List[nodes.Node] = []
    for block in re.split(r"\n\s*\n", text.strip()):
        if not block.strip():
            continue
        if any(line.startswith("  ") for line in block.splitlines()[1:]) or block.startswith("  "):
            out.append(nodes.literal_block(block, block))
        else:
            out.append(nodes.paragraph(block, " ".join(line.strip() for line in block.splitlines())))
    return out


class CppHeaderDirective(SphinxDirective):
    """``{cpp-header} posenc/<name>.h``: the header's comments and declarations as a section."""

    required_arguments = 1
    has_content = False

    def run(self) -> List[nodes.Node]:
        name = self.arguments[0]
        root = pathlib.Path(self.env.config.cpp_headers_root)
        path = root / name
        if not path.is_file():
            raise self.error(f"cpp-header: no header {name} under {root}")
        self.env.note_dependency(str(path))
        header = parse_header(path.read_text())
        section_id = nodes.make_id("cpp-header-" + name)
        section = nodes.section(ids=[section_id])
        section += nodes.title(name, "", nodes.literal(name, name))
        include = f"#include <{name}>"
        section += nodes.literal_block(include, include, language="cpp")
        section.extend(_paragraphs(header.leading))
        if header.includes:
            listed = nodes.paragraph("", "Includes ")
            for j, included in enumerate(header.includes):
                if j:
                    listed += nodes.Text(", ")
                listed += nodes.literal(included, included)
            listed += nodes.Text(".")
            section += listed
        for entry in header.entries:
            if entry.comment:
                section.extend(_paragraphs(entry.comment))
            if entry.code:
                section += nodes.literal_block(entry.code, entry.code, language="cpp")
        self.state.document.note_implicit_target(section, section)
        return [section]


def headers_named(text: str) -> List[str]:
    """The header names of every cpp-header directive in a page's Markdown."""
    return re.findall(r"```\{cpp-header\}\s+(\S+)", text)


def setup(app):
    app.add_config_value("cpp_headers_root", "", "env")
    app.add_directive("cpp-header", CppHeaderDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}


__all__: Optional[List[str]] = ["parse_header", "headers_named", "Entry", "Header"]
