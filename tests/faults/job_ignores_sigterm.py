"""A job that ignores SIGTERM, so that stopping it takes the whole grace period and then SIGKILL."""

import json
import os
import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.environ["LONGRUN_METRICS_FILE"], "a") as metrics:
    for step in range(1, 100000):
        metrics.write(json.dumps({"step": step, "loss": 1 / step}) + "\n")
        metrics.flush()
        time.sleep(0.05)
