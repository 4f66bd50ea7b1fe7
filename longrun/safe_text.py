"""What the command prints of the server's strings, made safe for a terminal.

A run's name, a host's field, a message, an error or a job's own log line may hold bytes a terminal obeys: ESC
sequences that clear the screen, set the window title or write the clipboard (OSC 52), a carriage return that
overwrites what was printed, C1 controls that some terminals read as ESC. `clean` removes them, whole sequences
first, then any control character left; the command passes every server string through it before printing
(`safe` for rich `Text`), and its consoles (`SafeConsole`) clean every segment they print once more, so a string
that reaches one by another path is still printed as text.
"""

import re
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.text import Text

# ESC sequences, removed whole: strings (OSC, DCS, SOS, PM, APC) up to their terminator (BEL or ST, in its 7- or
# 8-bit form); CSI with its parameters; any other ESC with its intermediate and final bytes. The 8-bit
# introducers (C1) likewise.
ESCAPE_SEQUENCE = re.compile(
    r"(?:\x1b[\]PX^_]|[\x9d\x90\x98\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"  # a terminated string
    r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"  # CSI
    r"|\x1b[ -/]*[0-~]"  # two-byte escapes and nF sequences
)
# C0 but tab and newline, DEL, C1: whatever of them a sequence above did not take
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Unicode's format characters (category Cf: bidi overrides and isolates, zero-width spaces and joiners, the BOM)
# and line and paragraph separators (Zl, Zp), as of Unicode 15.1: a terminal shows them as nothing, or reorders
# the text after them (U+202E shows `txt.exe` as `exe.txt`: Trojan Source, CVE-2021-42574). They are shown as
# `<U+202E>`, as GitHub shows hidden characters (tests/unit/test_terminal_injection.py pins the ranges to
# unicodedata's)
FORMAT = re.compile("[\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2\u180e\u200b-\u200f\u2028-\u202e"
                    "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
                    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]")
ANY_CONTROL = re.compile(f"[\x00-\x08\x0a-\x1f\x7f-\x9f]|{FORMAT.pattern}")


def clean(text: str, multiline: bool = False) -> str:
    """`text` without terminal control: escape sequences and control characters removed; a tab is kept, and a
    newline where one belongs (`multiline`: a traceback, a message of several lines), else it reads as a space;
    format characters made visible (`<U+202E>`)."""
    if not ANY_CONTROL.search(text):
        return text  # the common case, at the cost of one scan
    text = CONTROL.sub("", ESCAPE_SEQUENCE.sub("", text))
    text = FORMAT.sub(lambda m: f"<U+{ord(m[0]):04X}>", text)
    return text if multiline else text.replace("\n", " ")


def safe(text: str | None, style: str = "", **options: Any) -> Text:
    """A rich `Text` of a server string, cleaned (one line unless multiline=True)."""
    multiline = options.pop("multiline", False)
    return Text(clean(text or "", multiline), style=style, **options)


class SafeConsole(Console):
    """A rich console whose printed text cannot hold terminal control: each segment's text is cleaned, newlines
    kept (rich's own control segments, a live panel's cursor moves, pass as they are; styles are rendered after)."""

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None):  # type: ignore[override]
        for segment in super().render(renderable, options):
            if segment.control or not ANY_CONTROL.search(segment.text):
                yield segment
            else:
                yield Segment(clean(segment.text, multiline=True), segment.style)
