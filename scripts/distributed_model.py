#!/usr/bin/env python3
"""The cost model of docs/distributed.md, fed with bench_mpi's measured per-block times.

    bash scripts/bench_mpi.sh 16384 65536 | tee bench_mpi.txt
    python3 scripts/distributed_model.py bench_mpi.txt

Reads the `block n=... seconds=...` lines (one unmasked block of n queries x n keys, B = 1, H = 8, D = Dv = 128, one
thread) and the `result` lines, and prints, for causal prefills of T = 65536 and T = 1048576 over P = 8 ... 1024 ranks:
the ring's per-step compute time (zigzag: two full blocks of n/2 x n/2 per step, n = T/P), its message of one K/V
block, the bandwidth at which that message hides behind the step (beta_hide = bytes / compute), and the predicted time
and speedup over one process on two interconnects (the interconnect numbers are assumptions, stated in the output, not
measurements); and Ulysses' limit (P <= H = 8 heads here). Blocks smaller or larger than those measured take the rate
of the nearest measured block (the per-call overhead is then under- or over-stated: said in the output).
Standard library only.
"""
import math
import re
import sys

HEADS, D = 8, 128
BYTES = 4  # float
NETWORKS = [  # (name, bytes/s per direction per rank, latency per message in s): assumptions, not measurements
    ("IB HDR 25 GB/s 2 us", 25e9, 2e-6),
    ("25 GbE 3 GB/s 30 us", 3e9, 30e-6),
]


def main():
    text = open(sys.argv[1]).read() if len(sys.argv) > 1 else sys.stdin.read()
    blocks = {int(n): float(t) for n, t in re.findall(r"^block n=(\d+) seconds=([\d.e+-]+)", text, re.M)}
    single = {int(T): float(t) for T, t in re.findall(r"^result T=(\d+) ranks=1 layout=single seconds=([\d.]+)", text, re.M)}
    if not blocks:
        sys.exit("no `block` lines: run bench_mpi with one rank first (scripts/bench_mpi.sh does)")
    # The large-block rate: the single-process causal runs (visible pairs T(T+1)/2 per head).
    rates = {T: 0.5 * T * (T + 1) * HEADS * 2 * (D + D) / t for T, t in single.items()}
    large_rate = max(rates.values()) if rates else None

    def full_block_seconds(m):
        """One unmasked block of m x m: measured, or scaled from the nearest measured size by m^2."""
        if m in blocks:
            return blocks[m]
        if m > max(blocks) and large_rate:
            return m * m * HEADS * 2 * (D + D) / large_rate
        nearest = min(blocks, key=lambda n: abs(math.log(n / m)))
        return blocks[nearest] * (m / nearest) ** 2

    print("measured unmasked blocks (one thread): " +
          ", ".join(f"n={n}: {t * 1e3:.3f} ms ({n * n * HEADS * 2 * 2 * D / t * 1e-9:.1f} GFLOPS)"
                    for n, t in sorted(blocks.items())))
    for T, r in sorted(rates.items()):
        print(f"one process, causal T={T}: {single[T]:.2f} s, {r * 1e-9:.1f} GFLOPS")
    print(f"smallest measured block {min(blocks)}; a smaller one takes its per-pair time (the per-call overhead is "
          f"then understated). A ring step's time is P x max(compute, 2 latencies + block / bandwidth); efficiency ="
          f" one process's time / (P x the ring's time): above 1 where small blocks run at a better rate than one large"
          f" call (cache), below where the step's communication or fixed costs show")
    for T in (65536, 1048576):
        t_single = single.get(T) or (0.5 * T * (T + 1) * HEADS * 2 * (D + D) / large_rate)
        print(f"\ncausal T = {T} (one process: {t_single:.1f} s{' measured' if T in single else ', scaled'}), "
              f"H = {HEADS}, D = {D}, zigzag ring")
        header = f"{'P':>5} {'n=T/P':>7} {'step compute':>14} {'K/V block':>11} {'beta_hide':>11}"
        for name, _, _ in NETWORKS:
            header += f" | {name:>19}: time, speedup, efficiency"
        print(header)
        for P in (8, 16, 32, 64, 128, 256, 512, 1024):
            n = T // P
            step = 2 * full_block_seconds(max(n // 2, 1))
            block_bytes = HEADS * n * 2 * D * BYTES
            row = f"{P:>5} {n:>7} {step * 1e3:>11.3f} ms {block_bytes / 2**20:>7.2f} MiB {block_bytes / step / 1e9:>6.3f} GB/s"
            for _, beta, alpha in NETWORKS:
                comm = 2 * alpha + block_bytes / beta
                total = P * max(step, comm)
                row += f" | {total:>12.3f} s, {t_single / total:>7.1f}x, {t_single / total / P:>5.2f}"
            print(row)
    print("\nUlysses: P <= Hq = 8 here (Hq must divide by P); each rank computes 1/P of the heads over the whole sequence "
          "and sends about its own q, k, v, out shards once (5 all-to-alls, not overlapped).")


if __name__ == "__main__":
    main()
