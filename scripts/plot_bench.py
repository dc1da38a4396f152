#!/usr/bin/python3
"""Reads bench_attention's JSON output, prints the complexity slopes, the memory table, the read loop at each of its
placements and each decode row against its roofline and against the read loop with decode's FMAs (decode_roofline),
and plots GFLOPS against T.

    OMP_WAIT_POLICY=passive ./build/bench/bench/bench_attention --benchmark_min_time=0.3 \\
        --benchmark_out=bench.json --benchmark_out_format=json
    /usr/bin/python3 scripts/plot_bench.py bench.json --out bench.png      # or bench.svg; --no-plot: text only

Decode rows come from runs of their own, ten repetitions of every row in a random order (their medians are read
here), two-thread rows with an active team (a passive one slows them; bench/README.md):

    OMP_WAIT_POLICY=active ./build/bench/bench/bench_attention --benchmark_min_time=0.3 \\
        --benchmark_repetitions=10 --benchmark_enable_random_interleaving=true \\
        --benchmark_filter='BM_FmaPeak|BM_(Read(Fma)?|DecodeStep)Loop/.*threads:2/|BM_FusedDecode/.*threads:2/' \\
        --benchmark_out=decode2.json --benchmark_out_format=json
    /usr/bin/python3 scripts/plot_bench.py decode2.json --no-plot

Slopes (seed 000, 定理 2.4.3: O(T²·d) time, and the fused kernel's O(T·D) memory against the naive O(T²)) are
least-squares fits of log(real time) or log(MiB) against log(T) or log(D) over the one-thread, non-causal rows
(T ≥ 1024 for the slope against T, where fixed costs no longer show). Needs Debian's python3-matplotlib for the
plot only.
"""
import argparse
import json
import math
import re
import sys

NAME = re.compile(r"BM_(\w+?)/(.*?)(/real_time)?$")


def parse(path):
    """One dict per benchmark row: kind, its arguments (T, D, causal, threads, Skv) and its counters."""
    with open(path) as f:
        data = json.load(f)
    benchmarks = [b for b in data["benchmarks"] if not b.get("error_occurred")]
    # With --benchmark_repetitions, one row per benchmark: the median aggregate where there is one.
    medians = {b["run_name"] for b in benchmarks if b.get("aggregate_name") == "median"}
    rows = []
    for b in benchmarks:
        if b.get("run_name") in medians:
            if b.get("aggregate_name") != "median":
                continue
        elif b.get("run_type", "iteration") != "iteration":
            continue
        m = NAME.match(b.get("run_name", b["name"]))
        kind, args = (m.group(1), m.group(2)) if m else (b.get("run_name", b["name"]).replace("BM_", ""), "")
        row = {"kind": kind, "real_time": b["real_time"], "time_unit": b.get("time_unit", "ns")}
        for part in args.split("/"):
            if ":" in part:
                key, value = part.split(":", 1)
                row[key] = int(value)
        for counter in ("GFLOPS", "GBps", "alloc_MiB", "scores_MiB", "inputs_MiB"):
            if counter in b:
                row[counter] = b[counter]
        rows.append(row)
    return data.get("context", {}), rows


def slope(points):
    """Least-squares slope of log y against log x (NaN for fewer than two points)."""
    points = [(x, y) for x, y in points if x > 0 and y > 0]
    if len(points) < 2:
        return float("nan")
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else float("nan")


def pick(rows, kind, **where):
    return [r for r in rows if r["kind"] == kind and all(r.get(k) == v for k, v in where.items())]


def report(rows):
    peak = pick(rows, "FmaPeak")
    sgemm = pick(rows, "EigenSgemm")
    if peak:
        print(f"FMA loop {peak[0]['GFLOPS']:.1f} GFLOPS" +
              (f"; Eigen SGEMM 2048³ {sgemm[0]['GFLOPS']:.1f} GFLOPS" if sgemm else ""))
    print("\nTime against T (fused, one thread, not causal, T ≥ 1024; seed 000 定理 2.4.3 predicts 2):")
    for D in (64, 128):
        pts = sorted((r["T"], r["real_time"]) for r in pick(rows, "FusedPrefill", D=D, causal=0, threads=1)
                     if r["T"] >= 1024)
        if len(pts) >= 2:
            print(f"  D={D}: slope {slope(pts):.2f} over T = {', '.join(str(t) for t, _ in pts)}")
        pts = sorted((r["T"], r["real_time"]) for r in pick(rows, "NaiveEigenPrefill", D=D) if r["T"] >= 1024)
        if len(pts) >= 2:
            print(f"  D={D}, naive Eigen: slope {slope(pts):.2f} over T = {', '.join(str(t) for t, _ in pts)}")
    pts = sorted((r["D"], r["real_time"]) for r in pick(rows, "FusedPrefill", T=2048, causal=0, threads=1))
    if len(pts) >= 2:
        print("\nTime against D (fused, T = 2048, one thread, not causal; predicted 1):")
        base = dict(pts).get(64)
        if base:
            print("  time relative to D = 64: " + ", ".join(f"D={d}: {t / base:.2f}" for d, t in pts))
        print(f"  slope {slope(pts):.2f} over D = {', '.join(str(d) for d, _ in pts)}; "
              f"D ≥ 64: {slope([p for p in pts if p[0] >= 64]):.2f}")
    print("\nMemory against T (D = 64, one call):")
    print("  T       fused alloc MiB   inputs MiB   naive scores MiB")
    fused = {r["T"]: r for r in pick(rows, "FusedPrefill", D=64, causal=0, threads=1) if "alloc_MiB" in r}
    naive = {r["T"]: r for r in pick(rows, "NaiveEigenPrefill", D=64) if "scores_MiB" in r}
    for T in sorted(set(fused) | set(naive)):
        f = fused.get(T, {})
        n = naive.get(T, {})
        print(f"  {T:<7d} {f.get('alloc_MiB', float('nan')):>15.2f} {f.get('inputs_MiB', n.get('inputs_MiB', float('nan'))):>12.1f}"
              f" {n.get('scores_MiB', float('nan')):>18.1f}")
    if len(fused) >= 2:
        print(f"  slope of the fused allocation against T: {slope(sorted((T, r['alloc_MiB']) for T, r in fused.items())):.2f}")
    if len(naive) >= 2:
        print(f"  slope of the naive score matrix against T: {slope(sorted((T, r['scores_MiB']) for T, r in naive.items())):.2f}")
    decode_roofline(rows)


STORAGE = {0: "float", 1: "f16", 2: "bf16"}


def of_read_loop(rows, r):
    """r's GB/s over the read loop's at the same Skv and threads, at its faster placement (nan without one)."""
    read = pick(rows, "ReadLoop", Skv=r["Skv"], threads=r["threads"])
    return r["GBps"] / max(x["GBps"] for x in read) if read else float("nan")


def decode_roofline(rows):
    """Each decode row against its roofline: the larger of its share of the read loop's rate (bytes per second,
    same Skv and threads, the faster of its placements) and its share of the FMA loop's rate (one thread's, times the
    threads). Decode does 2·(D + Dv) FLOPs per (query head, key) over D + Dv stored elements per (kv head, key): G / 2
    FLOPs per byte of float K and V at G = Hq / Hkv, G per byte of 16-bit ones; where the FMA loop's rate is below that
    many times the read loop's (from L3 on a core whose FMAs are 256 bits wide, or whose read from L3 is fast), the
    arithmetic, not the read, bounds it. Then the read loop with decode's FMAs (BM_ReadFmaLoop) and decode's steps
    alone (BM_DecodeStepLoop) against the read loop, each float decode row against the latter.
    """
    peak = pick(rows, "FmaPeak")
    decode = pick(rows, "FusedDecode")
    if not decode:
        return
    reads = pick(rows, "ReadLoop")
    if reads:
        # bench_attention reads the bytes on cache lines (offset 0) and 16 bytes past them: the faster is the
        # memory's speed (on one Zen 4 thread the straddling loads mostly read about a tenth faster from DRAM).
        print("\nRead loop (GB/s) by placement, bytes past a cache line:")
        for Skv, threads in sorted({(r["Skv"], r["threads"]) for r in reads}):
            # Runs from before the offset argument read one placement, unrecorded: 16 bytes off (glibc's) until the
            # thirtieth session of bench/README.md, on lines in it.
            by = sorted((r.get("offset", -1), r["GBps"]) for r in pick(rows, "ReadLoop", Skv=Skv, threads=threads))
            print(f"  Skv {Skv:<6d} threads {threads}: " +
                  ", ".join(f"offset {o}: {g:.1f}" if o >= 0 else f"{g:.1f} (placement not recorded)" for o, g in by))
    print("\nDecode against its roofline (Sq = 1, Hq = 32, Hkv = 8, D = 128; shares of the same run's loops, the read")
    print("loop's faster placement; the last column: of the read loop with decode's FMAs, float rows only):")
    print("  layout storage Skv    threads  GB/s   of read loop  GFLOP/s  of FMA loop  of roofline  bound  of read+FMA")
    for r in sorted(decode, key=lambda r: (r.get("bshd", 0), r.get("storage", 0), r["Skv"], r["threads"])):
        of_read = of_read_loop(rows, r)
        of_fma = r["GFLOPS"] / (peak[0]["GFLOPS"] * r["threads"]) if peak else float("nan")
        # The bound is the loop that would take longer over this row's bytes and FLOPs.
        bound = "FMA" if of_fma > of_read else "read" if of_read == of_read else "?"
        # BM_ReadFmaLoop streams float bytes with decode's multiply-adds for float K and V (G per vector): a 16-bit
        # row does as many per element over half the bytes, so it is compared with float rows only.
        both = pick(rows, "ReadFmaLoop", Skv=r["Skv"], threads=r["threads"])
        of_both = f"{r['GBps'] / both[0]['GBps']:.2f}" if both and r.get("storage", 0) == 0 else "-"
        print(f"  {'bshd' if r.get('bshd') else 'bhsd':<6} {STORAGE.get(r.get('storage', 0), '?'):<7} {r['Skv']:<6d} "
              f"{r['threads']:<8d} {r['GBps']:<6.1f} {of_read:<13.2f} {r['GFLOPS']:<8.1f} {of_fma:<12.2f} "
              f"{max(of_read, of_fma):<12.2f} {bound:<6} {of_both}")
    # BM_ReadFmaLoop: the read loop with decode's multiply-adds. BM_DecodeStepLoop: decode's micro-kernel steps over
    # head-major float K and V with none of the kernel's bookkeeping and no software prefetch, and what the float decode
    # rows read against it.
    for kind, title, with_decode in (("ReadFmaLoop", "Read loop with decode's FMAs", False),
                                     ("DecodeStepLoop", "Decode's steps alone", True)):
        loops = pick(rows, kind)
        if not (loops and reads):
            continue
        print(f"\n{title} (GB/s, of the read loop's faster placement" + ("; float decode rows of it):" if with_decode
                                                                          else "):"))
        for r in sorted(loops, key=lambda r: (r["Skv"], r["threads"])):
            line = f"  Skv {r['Skv']:<6d} threads {r['threads']}: {r['GBps']:.1f} ({of_read_loop(rows, r):.2f})"
            floats = [x for x in pick(rows, "FusedDecode", Skv=r["Skv"], threads=r["threads"])
                      if x.get("storage", 0) == 0]
            if with_decode and floats:
                line += "; decode " + ", ".join(f"{'bshd' if x.get('bshd') else 'bhsd'} {x['GBps'] / r['GBps']:.2f}"
                                                for x in sorted(floats, key=lambda x: x.get("bshd", 0)))
            print(line)

def plot(context, rows, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, D in zip(axes, (64, 128)):
        for threads, causal, style in ((1, 0, "o-"), (1, 1, "o--"), (2, 0, "s-"), (2, 1, "s--")):
            pts = sorted((r["T"], r["GFLOPS"]) for r in pick(rows, "FusedPrefill", D=D, causal=causal, threads=threads))
            if pts:
                ax.plot(*zip(*pts), style, label=f"qkv fused, {threads} thread{'s' if threads > 1 else ''}"
                        f"{', causal' if causal else ''}")
        pts = sorted((r["T"], r["GFLOPS"]) for r in pick(rows, "NaiveEigenPrefill", D=D))
        if pts:
            ax.plot(*zip(*pts), "^-", color="gray", label="naive Eigen (S = QKᵀ, softmax, PV)")
        pts = sorted((r["T"], r["GFLOPS"]) for r in pick(rows, "ReferencePrefill", D=D))
        if pts:
            ax.plot(*zip(*pts), "x", color="black", label="qkv reference (float64)")
        for kind, color, text in (("FmaPeak", "red", "FMA loop (1 thread)"), ("EigenSgemm", "purple", "Eigen SGEMM 2048³")):
            r = pick(rows, kind)
            if r:
                ax.axhline(r[0]["GFLOPS"], color=color, linestyle=":", label=text)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (Sq = Skv), B = 1, H = 8")
        ax.set_title(f"D = {D}, float")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GFLOP/s (2·(D + Dv) per visible pair)")
    axes[1].legend(fontsize=7, loc="lower right")
    host = context.get("host_name", "")
    fig.suptitle(f"qkv prefill, {context.get('date', '')} {host} ({context.get('num_cpus', '?')} CPUs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    print(f"\nwrote {out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="bench_attention --benchmark_out=<file> --benchmark_out_format=json")
    parser.add_argument("--out", default="bench.png", help="the plot: .png or .svg")
    parser.add_argument("--no-plot", action="store_true",
                        help="print the tables only (slopes, memory, read loop, decode)")
    args = parser.parse_args()
    context, rows = parse(args.json)
    report(rows)
    if not args.no_plot:
        plot(context, rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
