from spin.zoo.roff import roff_to_text

PAGE = r""".\" a comment that must not appear
.de XX
.  macro body that must not appear
..
.TH DEMO 1 "2024" "demo 1.0" "User Commands"
.SH NAME
demo \- show a \fBbold\fR word
.SH OPTIONS
.TP
.BR \-v ", " \-\-verbose
Print more\(emmuch more.
.if n \{\
conditional text that must not appear
.\}
.PP
Second paragraph with \fIitalic\fP and an escaped\ space.
"""


def test_keeps_text_and_drops_requests() -> None:
    text = roff_to_text(PAGE)
    assert "NAME" in text and "demo - show a bold word" in text
    assert "-v, --verbose" in text
    assert "Print more--much more." in text
    assert "Second paragraph with italic and an escaped space." in text
    for hidden in ("comment", "macro body", "conditional text", "\\f", ".TH"):
        assert hidden not in text


def test_paragraphs_are_separated() -> None:
    paragraphs = roff_to_text(PAGE).split("\n\n")
    assert paragraphs[0] == "NAME"
    assert any(p.startswith("Second paragraph") for p in paragraphs)


def test_redirect_pages_have_no_text() -> None:
    assert roff_to_text(".so man1/other.1\n") == ""


def test_mdoc_flags() -> None:
    assert roff_to_text(".Sh SYNOPSIS\n.Nm ssh\n.Op Fl v Ar host\n") == "SYNOPSIS\n\nssh -v host"
