"""A torchrun job whose rank 1 raises after a few steps (a data shard it cannot find), its main wrapped in torch
elastic's @record as the bundled trainer's is; rank 0 waits to be stopped."""

import json
import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    for step in range(1, 4):
        if rank == 0:
            with open(os.environ["LONGRUN_METRICS_FILE"], "a") as metrics:
                metrics.write(json.dumps({"step": step, "total_steps": 100, "loss": 1 / step}) + "\n")
        time.sleep(0.1)
    if rank == 1:
        with open("/nonexistent/shard-00001.bin", "rb"):
            pass
    time.sleep(60)


main()
