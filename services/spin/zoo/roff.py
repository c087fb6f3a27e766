"""Turn man(7)/mdoc(7) roff source into plain prose, without groff.

Rendering 5,000 pages through ``man`` takes minutes and depends on the installed groff; this
stripper is pure Python, deterministic and fast. It keeps the words of the page (headings, body,
option lists) and drops formatting requests, macro definitions and conditionals. It is good enough
for a language-model corpus, not a renderer.
"""

from __future__ import annotations

import re

# Named glyphs (\(xx and \[xx]) that carry text; the rest are dropped.
_GLYPHS: dict[str, str] = {
    "em": "--", "en": "-", "hy": "-", "mi": "-", "bu": "*", "aq": "'", "dq": '"', "lq": '"',
    "rq": '"', "oq": "'", "cq": "'", "co": "(c)", "rg": "(R)", "tm": "(TM)", "lh": "<=",
    "rh": "=>", "<-": "<-", "->": "->", "<=": "<=", ">=": ">=", "!=": "!=", "==": "==",
    "ti": "~", "ha": "^", "rs": "\\", "sl": "/", "ba": "|", "or": "|", "pl": "+", "mu": "x",
    "de": "deg", "ga": "`", "aa": "'", "la": "<", "ra": ">", "Fo": "<<", "Fc": ">>",
}

# Requests that end a paragraph; other requests without text are dropped.
_BREAKS = {"PP", "P", "LP", "TP", "IP", "sp", "br", "SH", "SS", "HP", "TQ", "Pp", "Sh", "Ss", "It"}
# Alternating-font macros: arguments are concatenated without spaces.
_ALTERNATING = {"BR", "RB", "IR", "RI", "BI", "IB"}
# Macros whose arguments are text (man and the common mdoc ones).
_TEXT_MACROS = {
    "B", "I", "SM", "SB", "SH", "SS", "TP", "IP", "Nm", "Nd", "Ar", "Fl", "Op", "Pa", "Em", "Sy",
    "Dq", "Qq", "Sq", "Li", "Cm", "Ic", "Va", "Fn", "Ft", "Fa", "Ev", "Er", "Xr", "Dv", "Sh", "Ss",
    "It", "Ql", "Ms", "Ad", "An", "Lk", "Mt", "Tn", "Ux",
}

_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),      # font changes
    (re.compile(r"\\s[+-]?(\d|\(\d\d|\[\d+\])"), ""),  # size changes
    (re.compile(r"\\\*(\[[^\]]*\]|\(..|.)"), ""),     # string interpolation
    (re.compile(r"\\n(\[[^\]]*\]|\(..|.)"), ""),      # number registers
    (re.compile(r"\\[hvwlLxXoSkz]'[^']*'"), ""),       # motions and measurements
    (re.compile(r"\\[&|^%:cdudp!]"), ""),              # zero-width and break escapes
    (re.compile(r"\\[-e]"), lambda m: "-" if m.group(0) == "\\-" else "\\"),
    (re.compile(r"\\ "), " "),
    (re.compile(r"\\~"), " "),
    (re.compile(r"\\0"), " "),
]
_GLYPH = re.compile(r"\\\((..)|\\\[([^\]]*)\]")


def _inline(text: str) -> str:
    """Resolve inline escapes of one line of text."""
    text = _GLYPH.sub(lambda m: _GLYPHS.get(m.group(1) or m.group(2), ""), text)
    for pattern, repl in _ESCAPES:
        text = pattern.sub(repl, text)
    return text.replace("\\", "")


def _args(line: str) -> list[str]:
    """Split macro arguments, honouring double quotes."""
    out: list[str] = []
    for m in re.finditer(r'"((?:[^"]|"")*)"|(\S+)', line):
        out.append(m.group(1).replace('""', '"') if m.group(1) is not None else m.group(2))
    return out


def _mdoc_args(args: list[str]) -> list[str]:
    """mdoc arguments with nested macro names removed; ``Fl x`` becomes ``-x``."""
    out: list[str] = []
    flag = False
    for a in args:
        if re.fullmatch(r"[A-Z][a-z]", a):
            flag = a == "Fl"
            continue
        out.append("-" + a if flag else a)
        flag = False
    return out


def roff_to_text(source: str) -> str:
    """Plain text of a man page: paragraphs separated by blank lines, no formatting."""
    paragraphs: list[list[str]] = [[]]
    skip_depth = 0
    in_definition = False
    for raw in source.splitlines():
        line = raw.rstrip()
        if in_definition:
            in_definition = line != ".."
            continue
        if skip_depth > 0:
            skip_depth += line.count("\\{") - line.count("\\}")
            continue
        if line.startswith(('.\\"', "'\\\"", '\\"', ".\\#")) or line in (".", "'"):
            continue
        if line.startswith((".", "'")):
            name, _, rest = line[1:].lstrip().partition(" ")
            if name in ("de", "de1", "am", "ig"):
                in_definition = True
                continue
            if name in ("if", "ie", "el", "while"):
                skip_depth = max(0, line.count("\\{") - line.count("\\}"))
                continue
            if name == "so":  # a redirect to another page: no text of its own
                return ""
            if name in _BREAKS and paragraphs[-1]:
                paragraphs.append([])
            args = [_inline(a) for a in _args(rest)]
            if name[:1].isupper() and name[1:].islower():  # mdoc: drop nested macro names
                args = _mdoc_args(args)
            if name in _ALTERNATING:
                paragraphs[-1].append("".join(args))
            elif name in _TEXT_MACROS and args:
                paragraphs[-1].append(" ".join(args))
            if name in ("SH", "Sh", "SS", "Ss") and paragraphs[-1]:
                paragraphs.append([])
            continue
        text = _inline(line).strip()
        if text:
            paragraphs[-1].append(text)
        elif paragraphs[-1]:
            paragraphs.append([])
    lines = [" ".join(p) for p in paragraphs if p]
    return "\n\n".join(re.sub(r"[ \t]+", " ", p).strip() for p in lines if p.strip())
