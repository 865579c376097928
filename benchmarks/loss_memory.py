"""Chunked vs direct loss: peak extra memory and forward+backward time, as ratios.

    python -m benchmarks.loss_memory                                   # V = 32k and 128k
    python -m benchmarks.loss_memory --vocab 128000 --positions 1024 --chunk-size 128

Run it as a module from the repo root: as a script, this file would shadow ``losses``.

Each (vocab, loss, method) runs in a fresh subprocess so peaks don't mix. Extra memory is
the peak above what the inputs (draft hidden [N, H], head [V, H], target logits [N, V],
mask) already hold: torch.cuda.max_memory_allocated on CUDA; on CPU the process's peak
RSS (VmHWM, reset through /proc/self/clear_refs) minus the RSS before the loss, with
glibc's mmap threshold pinned at 1 MiB so freed buffers leave RSS at once (otherwise
freed chunks stay resident and RSS overstates what is live). Pinning makes every buffer a
fresh mmap, which taxes the many chunk-sized buffers of the chunked run where they are
under 32 MiB (glibc would otherwise reuse them): on CPU the time ratio is conservative
for chunked at small V. Times are wall seconds of one forward+backward after a small
warm-up; the CPU-time ratio (process CPU seconds) is the steadier one on a shared
machine. Direct = compute_loss on the full ``hidden @ head.T``; chunked = chunked_loss.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdistill.losses import chunked_loss, compute_loss


def measure(method: str, name: str, vocab: int, args) -> dict:
    """One forward+backward; returns peak extra bytes, wall and process CPU seconds."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)

    def make(n: int, v: int):
        hidden = torch.randn(n, args.hidden, generator=generator, device=device)
        head = torch.randn(v, args.hidden, generator=generator, device=device) / args.hidden**0.5
        target = torch.randn(n, v, generator=generator, device=device) * 2
        mask = torch.rand(n, generator=generator, device=device) < 0.9
        return hidden.requires_grad_(), head.requires_grad_(), target, mask

    def step(hidden, head, target, mask):
        if method == "direct":
            loss, n_valid = compute_loss(name, hidden @ head.T, target, mask)
        else:
            loss, n_valid = chunked_loss(
                name, hidden, head, target, mask, chunk_size=args.chunk_size
            )
        (loss / n_valid).backward()

    step(*make(64, 1000))  # warm up kernels and thread pools outside the measurement
    inputs = make(args.positions, vocab)
    baseline = _reset_peak(device)
    start, start_cpu = time.perf_counter(), time.process_time()
    step(*inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    return {
        "extra_bytes": _peak(device) - baseline,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - start_cpu,
    }


def _reset_peak(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    return _status_kib("VmRSS") * 1024


def _peak(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


CASE = [sys.executable, "-m", "benchmarks.loss_memory", "--case"]


def _run(command: list[str]) -> dict:
    output = subprocess.run(
        command,
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    )
    return json.loads(output.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--losses", nargs="+", default=["fkl", "tv", "lk_lambda"])
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--case", nargs=3, metavar=("METHOD", "LOSS", "VOCAB"), help="internal")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.case:
        method, name, vocab = args.case
        print(json.dumps(measure(method, name, int(vocab), args)))
        return

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"device={device} threads={torch.get_num_threads()} positions={args.positions} "
        f"hidden={args.hidden} chunk_size={args.chunk_size}; one forward+backward per run"
    )
    header = (
        f"{'vocab':>7} {'loss':>10} {'direct MiB':>11} {'chunked MiB':>12} {'mem ratio':>10} "
        f"{'direct s':>9} {'chunked s':>10} {'time ratio':>11} {'cpu-time ratio':>15}"
    )
    print(header)
    flags = ["--positions", str(args.positions), "--hidden", str(args.hidden)]
    flags += ["--chunk-size", str(args.chunk_size)]
    flags += ["--threads", str(args.threads)] if args.threads else []
    for vocab in args.vocab:
        for name in args.losses:
            direct, chunked = (
                _run([*CASE, method, name, str(vocab), *flags]) for method in ("direct", "chunked")
            )
            print(
                f"{vocab:>7} {name:>10} {direct['extra_bytes'] / 2**20:>11.0f} "
                f"{chunked['extra_bytes'] / 2**20:>12.0f} "
                f"{chunked['extra_bytes'] / direct['extra_bytes']:>10.3f} "
                f"{direct['seconds']:>9.2f} {chunked['seconds']:>10.2f} "
                f"{chunked['seconds'] / direct['seconds']:>11.3f} "
                f"{chunked['cpu_seconds'] / direct['cpu_seconds']:>15.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
