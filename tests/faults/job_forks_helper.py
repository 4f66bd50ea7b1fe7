"""A job that starts a helper outside its environment and session (`env -i setsid`, as an evaluation or
inference server might) and writes the helper's pid to argv[1]; then it works until stopped."""

import json
import os
import subprocess
import sys
import time

helper = subprocess.Popen(["env", "-i", "setsid", sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(helper.pid))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
with open(os.environ["LONGRUN_METRICS_FILE"], "a") as metrics:
    for step in range(1, 100000):
        metrics.write(json.dumps({"step": step, "loss": 1 / step}) + "\n")
        metrics.flush()
        time.sleep(0.05)
