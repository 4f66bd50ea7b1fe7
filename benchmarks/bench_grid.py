"""The trainer's 18-cell grid against the peer (speculators) in one command, on every GPU of the machine.

    python3 benchmarks/bench_grid.py --peer .peer/bench_speculators.py --peer-wheels .whl --out $OUT/grid.jsonl
    python3 benchmarks/bench_grid.py --only longrun 8192x1 8192x5          # some cells, ours only
    python3 benchmarks/bench_grid.py --table grid.jsonl [more.jsonl ...]   # the table from saved lines, no GPU
    python3 benchmarks/bench_grid.py --tiny --steps 2 64x1 64x3 --out /tmp/g.jsonl   # CPU check of the command

Cells are SEQxTTT for SEQ in 2048, 4096, 8192 and TTT in 1, 3, 5, 7, 10, 16 unless given. The work is cut
into one job per trainer and sequence length (`benchmarks/bench_trainer.py` for longrun, the peer's
`bench_speculators.py` with PEER_MODE=flex), longest first, and each GPU runs one job at a time: on one GPU
everything runs in turn; on two or more, ours and the peer's run side by side on identical GPUs.
Every result line is appended to `--out` as it comes, so a run cut short still leaves a table; the
table says per cell ours and the peer's ms/step, tokens/s and peak memory, the marginal TTT step's
FLOP rate over the measured bf16 matmul rate, and the ratio, then the aims of issue 18.
"""

import argparse
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (2048, 4096, 8192)
DEPTHS = (1, 3, 5, 7, 10, 16)


def gpu_count() -> int:
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(line.startswith("GPU ") for line in listing.splitlines())


def install_peer_wheels(wheels: Path, site: Path) -> None:
    if not (site / "speculators").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))],
                       check=True)


def jobs_for(cells: list[tuple[int, int]], trainers: list[str], peer: Path | None,
             extra: list[str]) -> list[tuple[str, list[str], list[str]]]:
    """(name, command, cell arguments) per trainer and sequence length, the longest sequences first."""
    jobs = []
    for seq in sorted({s for s, _ in cells}, reverse=True):
        args = [f"{s}x{t}" for s, t in cells if s == seq]
        for trainer in trainers:
            if trainer == "longrun":
                command = [sys.executable, str(ROOT / "benchmarks" / "bench_trainer.py"), *extra]
            else:
                command = [sys.executable, str(peer)]
            jobs.append((f"{trainer} {seq}", command + args, args))
    return jobs


def run_jobs(jobs, gpus: int, out: Path, env: dict, deadline: float) -> None:
    """Each GPU (or the CPU when there is none) runs one job at a time; result lines go to `out` and stdout."""
    pending: queue.Queue = queue.Queue()
    for job in jobs:
        pending.put(job)
    lock = threading.Lock()

    def worker(gpu: int | None) -> None:
        while True:
            try:
                name, command, _ = pending.get_nowait()
            except queue.Empty:
                return
            job_env = dict(env, PYTHONUNBUFFERED="1")
            if gpu is not None:
                job_env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            with lock:
                print(f"# {time.strftime('%H:%M:%S')} GPU {gpu}: {name}", flush=True)
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=job_env, cwd=ROOT)
            timer = threading.Timer(max(deadline - time.time(), 0), process.kill)
            timer.start()
            for line in process.stdout:
                try:
                    result = json.loads(line)
                except json.JSONDecodeError:
                    continue  # warnings and compiler chatter
                result["gpu"] = gpu
                with lock:
                    print(json.dumps(result), flush=True)
                    with out.open("a") as f:
                        f.write(json.dumps(result) + "\n")
            process.wait()
            timer.cancel()
            if process.returncode:
                with lock:
                    print(f"# {name} on GPU {gpu} ended with code {process.returncode}", flush=True)

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in (range(gpus) if gpus else [None])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def read_results(paths: list[Path]) -> tuple[dict, dict]:
    """(ours, the peer's) by (seq, ttt); a later line for the same cell replaces an earlier one."""
    ours, peer = {}, {}
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            result = json.loads(line)
            cell = (result["seq"], result["ttt"])
            (ours if result.get("trainer") == "longrun" else peer)[cell] = result
    return ours, peer


def _number(result: dict | None, key: str, digits: int = 2) -> str:
    value = None if result is None else result.get(key)
    if value is None:
        return "–" if result is None or "error" not in result else "error"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def table(ours: dict, peer: dict) -> str:
    rows = [
        "| seq × TTT | longrun ms/step | longrun tokens/s | longrun peak GiB | marginal TFLOP/s | marginal / matrix rate "
        "| speculators ms/step | speculators tokens/s | speculators peak GiB | longrun / speculators (tokens/s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios, long_ratios, lighter, heavier, rates = [], [], 0, [], []
    for cell in sorted(set(ours) | set(peer)):
        a, b = ours.get(cell), peer.get(cell)
        ratio = None
        if a and b and a.get("tokens_per_s") and b.get("tokens_per_s"):
            ratio = a["tokens_per_s"] / b["tokens_per_s"]
            ratios.append(ratio)
            if cell[0] == 8192:
                long_ratios.append(ratio)
            if a["peak_gib"] < b["peak_gib"]:
                lighter += 1
            else:
                heavier.append(cell)
        if a and a.get("mfu_marginal"):
            rates.append(a["mfu_marginal"])
        rows.append(
            f"| {cell[0]} × {cell[1]} | {_number(a, 'ms_per_step')} | {_number(a, 'tokens_per_s')} | "
            f"{_number(a, 'peak_gib')} | {_number(a, 'tflops_marginal', 0)} | {_number(a, 'mfu_marginal')} | "
            f"{_number(b, 'ms_per_step')} | {_number(b, 'tokens_per_s')} | {_number(b, 'peak_gib')} | "
            f"{f'**{ratio:.2f}×**' if ratio else '–'} |"
        )
    matrix = sorted({a["matmul_tflops"] for a in ours.values() if a.get("matmul_tflops")})
    rows.append("")
    if matrix:
        rows.append(f"measured bf16 matrix rate: {', '.join(f'{m:.0f}' for m in matrix)} TFLOP/s")
    if ratios:
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        rows.append(f"cells with both: {len(ratios)}; ahead in {sum(r > 1 for r in ratios)}; "
                    f"geometric mean {geomean:.2f}× (aim ≥ 1.5×); range {min(ratios):.2f}×–{max(ratios):.2f}×")
        rows.append(f"peak memory lower in {lighter} of {len(ratios)} cells" + (f"; not in {heavier}" if heavier else ""))
    if long_ratios:
        rows.append(f"8192-token cells: lowest {min(long_ratios):.2f}× (aim ≥ 1.3× in each)")
    if rates:
        rows.append(f"marginal TTT step / matrix rate: {min(rates):.2f}–{max(rates):.2f} (aim ≥ 0.70)")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cells", nargs="*", help="SEQxTTT (default: the 18 cells)")
    p.add_argument("--peer", type=Path, help="the peer's bench_speculators.py (without it: ours only)")
    p.add_argument("--peer-wheels", type=Path, help="a folder of wheels the peer imports, installed into --peer-site")
    p.add_argument("--peer-site", type=Path, default=Path("/tmp/site"))
    p.add_argument("--only", choices=["longrun", "speculators"])
    p.add_argument("--out", type=Path, default=Path("grid.jsonl"), help="result lines, appended")
    p.add_argument("--deadline-s", type=float, default=560, help="jobs still running after this are killed")
    p.add_argument("--tiny", action="store_true", help="ours only, a tiny draft: a CPU check of the whole command")
    p.add_argument("--steps", type=int, help="timed steps per cell of ours (bench_trainer's default otherwise)")
    p.add_argument("--table", type=Path, nargs="+", help="only print the table of these result files")
    args = p.parse_args(argv)
    if args.table:
        print(table(*read_results(args.table)))
        return
    cells = [tuple(map(int, c.split("x"))) for c in args.cells] or [(s, t) for s in LENGTHS for t in DEPTHS]
    trainers = [t for t in ("longrun", "speculators") if args.only in (None, t)]
    if args.peer is None or args.tiny:
        trainers = [t for t in trainers if t == "longrun"]
    env = dict(os.environ, PEER_MODE="flex")
    if args.peer_wheels:
        install_peer_wheels(args.peer_wheels, args.peer_site)
    if "speculators" in trainers:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.peer_site), env.get("PYTHONPATH")]))
    extra = ["--tiny"] * args.tiny
    extra += ["--steps", str(args.steps), "--warmup", str(min(args.steps, 4))] if args.steps else []
    gpus = gpu_count()
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {len(cells)} cells, {trainers}, {gpus} GPU(s) -> {args.out}",
          flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run_jobs(jobs_for(cells, trainers, args.peer, extra), gpus, args.out, env, time.time() + args.deadline_s)
    print(table(*read_results([args.out])))


if __name__ == "__main__":
    main()
