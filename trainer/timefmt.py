"""How the trainer's log lines write a duration: `45s`, `4m 12s`, `1h 23m`, `2d 3h`, the format of `longrun watch`
and the page (longrun/views.py `duration`, server/web/dom.js), so that a log and the command say an ETA alike."""


def duration(seconds: float) -> str:
    s = max(0, round(seconds))
    d, h, m = s // 86400, s % 86400 // 3600, s % 3600 // 60
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {s % 60:02d}s"
    return f"{s}s"
