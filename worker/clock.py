"""The worker's clocks, injectable so that deadlines and intervals can be tested without waiting."""

import time
from datetime import datetime

from server.models import utcnow


class Clock:
    def now(self) -> datetime:
        """Wall-clock time (UTC), for what is stored: deadlines measured against database times."""
        return utcnow()

    def monotonic(self) -> float:
        """Seconds that never go back, for intervals the worker keeps in memory."""
        return time.monotonic()
