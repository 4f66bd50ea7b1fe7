"""The verifier's forward as the advisor models it (server/advisor/verifier.py: bytes read and FLOPs) against a
probe-verifier measurement of the same shape (worker/verifier_probe.py's JSON line), token count by token count:
whether the two agree within 1.5x, the figure issue 54 asks of the Kimi-K2.5 shape.

    python3 worker/verifier_probe.py --config tests/fixtures/verifiers/kimi-k2.5 --tp 8 --ep 8 > probe.json
    python3 benchmarks/verifier_reconcile.py probe.json            # or a stored one: tests/fixtures/verifier-probe

Prints one JSON line per token count (modelled_ms, measured_ms, ratio) and a last line with the worst ratio and
`within_1_5x`. Plain arithmetic: runs anywhere (the probe needs the GPU)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.advisor.cost import CostModel  # noqa: E402
from server.advisor.tables import NVLINK_ALLREDUCE_US  # noqa: E402
from server.advisor.verifier import Parallelism, VerifierShape, read_probe  # noqa: E402

AGREE = 1.5


def reconcile(answer: dict) -> list[dict]:
    stored = read_probe(answer, "probe", "-")
    shape = VerifierShape.from_config(stored["config"], Path(str(stored["path"])).name)
    parallel = Parallelism(stored["tp"], stored["ep"])
    context = int(answer.get("context") or 4096)
    model = CostModel.for_verifier(shape, parallel, NVLINK_ALLREDUCE_US, context_tokens=context)
    measured = CostModel.for_verifier(shape, parallel, NVLINK_ALLREDUCE_US, measured=stored, context_tokens=context)
    rows = []
    for n in range(1, len(stored.get("moe_ms") or stored.get("dense_ms") or []) + 1):
        a, b = model.verifier_ms(n - 1), measured.verifier_ms(n - 1)
        rows.append({"tokens": n, "modelled_ms": round(a, 4), "measured_ms": round(b, 4), "ratio": round(b / a, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit(__doc__)
    answer = json.loads(Path(args[0]).read_text().strip().splitlines()[-1])
    rows = reconcile(answer)
    for row in rows:
        print(json.dumps(row))
    worst = max(rows, key=lambda r: max(r["ratio"], 1 / r["ratio"]))
    within = all(1 / AGREE <= r["ratio"] <= AGREE for r in rows)
    print(json.dumps({"gpu": answer.get("gpu"), "dtype": answer.get("dtype"), "moe_kernel": answer.get("moe_kernel"),
                      "worst_ratio": worst["ratio"], "at_tokens": worst["tokens"], "within_1_5x": within}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
