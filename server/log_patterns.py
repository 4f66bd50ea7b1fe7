"""What a run spec's `log_metrics` may say: the built-in log formats and per-run patterns.

The worker parses logs with these (worker/log_metrics.py); the API validates specs with them.
"""

import regex

FORMATS = ("tqdm", "key_value", "json")
MAX_PATTERNS = 16
MAX_PATTERN_CHARS = 1000


def compile_pattern(text: str) -> regex.Pattern[str]:
    """A per-run pattern: a regular expression (Python syntax) with at least one named group; ValueError says
    what is wrong. Compiled with `regex`, whose searches take a time limit."""
    if len(text) > MAX_PATTERN_CHARS:
        raise ValueError(f"a pattern may be at most {MAX_PATTERN_CHARS} characters")
    try:
        pattern = regex.compile(text)
    except (regex.error, RecursionError, OverflowError, ValueError) as exc:
        raise ValueError(f"not a regular expression: {exc}") from None
    if not pattern.groupindex:
        raise ValueError("a pattern needs a named group, such as (?P<loss>[0-9.]+); each names a series")
    for name in pattern.groupindex:
        if len(name) > 128:
            raise ValueError(f"group name {name[:20]!r}... is longer than 128 characters")
    return pattern
