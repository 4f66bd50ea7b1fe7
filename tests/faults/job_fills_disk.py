"""A job that fills the disk it runs on: a few metric lines, then a ballast file larger than the file system,
then more metric lines, which fail with ENOSPC."""

import json
import os
import time

with open(os.environ["LONGRUN_METRICS_FILE"], "a") as metrics:
    for step in range(1, 1000):
        metrics.write(json.dumps({"step": step, "loss": 1 / step}) + "\n")
        metrics.flush()
        time.sleep(0.05)
        if step == 5:
            print("writing the ballast", flush=True)
            try:
                with open("ballast", "wb") as ballast:
                    for _ in range(64):
                        ballast.write(b"\0" * (1 << 20))
            except OSError as exc:
                print(f"ballast stopped: {exc}", flush=True)
