#!/usr/bin/env python3
"""Runs the simulator's headline comparison and prints it as Markdown tables.

Every policy on both bundled data sets (K80, P100), seeds 1-5, in each job-information
mode asked for (default: `none`, what `iadeep run` gives, and `profiled`, for comparison),
with the simulator's defaults otherwise (300 Philly jobs, 20 GPUs). Each run writes its
CSV files under OUT/<worker>-<mode>-seed<seed>/; the tables are computed from their
summary.csv, so a table can be made again from a finished run with --summarise-only.

Usage:
    cargo build --release -p iadeep-cli
    scripts/sim-figures.py --bin target/release/iadeep --out sim-figures [--jobs 2]
"""

import argparse
import csv
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

PARTS = ["oracle-prediction", "oracle-memory", "oracle-tuning", "oracle-wait"]


def is_other(policy):
    """A policy iadeep is compared with: neither an iadeep variant nor an oracle."""
    return not policy.startswith("iadeep") and not policy.startswith("oracle")


def run_dir(out, worker, mode, seed):
    return os.path.join(out, f"{worker}-{mode}-seed{seed}")


def simulate(binary, out, worker, mode, seed, extra):
    folder = run_dir(out, worker, mode, seed)
    os.makedirs(folder, exist_ok=True)
    command = [
        binary, "sim", "--worker-type", worker, "--seed", str(seed),
        "--job-info", mode, "--out", folder, *extra,
    ]
    with open(os.path.join(folder, "stderr.log"), "w") as log:
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=log)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed; see {folder}/stderr.log")
    return folder


def summary(folder):
    with open(os.path.join(folder, "summary.csv")) as f:
        return {row["policy"]: row for row in csv.DictReader(f)}


def hours(row):
    return float(row["avg_ct_s"]) / 3600.0


def table(out, workers, modes, seeds):
    print("| data | mode | seed | iadeep avg CT h | crashes / fenced OOMs | best other (CT h) "
          "| iadeep below it | oracle CT h | iadeep over oracle |")
    print("|---|---|---|---|---|---|---|---|---|")
    means = {}
    for worker in workers:
        for mode in modes:
            for seed in seeds:
                rows = summary(run_dir(out, worker, mode, seed))
                iadeep, oracle = rows["iadeep"], rows["oracle"]
                others = [(name, hours(row)) for name, row in rows.items() if is_other(name)]
                best_name, best = min(others, key=lambda o: o[1])
                ct, ct_oracle = hours(iadeep), hours(oracle)
                means.setdefault((worker, mode), []).append(
                    (ct, best, ct_oracle, int(iadeep["ooms"]), int(iadeep["fenced_ooms"])))
                print(f"| {worker.upper()} | {mode} | {seed} | {ct:.2f} | "
                      f"{iadeep['ooms']} / {iadeep['fenced_ooms']} | {best_name} {best:.2f} | "
                      f"{100 * (1 - ct / best):.1f} % | {ct_oracle:.2f} | "
                      f"{100 * (ct / ct_oracle - 1):+.1f} % |")
    print()
    print("| data | mode | mean iadeep CT h | mean best other CT h | mean oracle CT h "
          "| iadeep over oracle (mean of runs) | runs beating every other | crashes |")
    print("|---|---|---|---|---|---|---|---|")
    for (worker, mode), runs in means.items():
        n = len(runs)
        mean = lambda i: sum(r[i] for r in runs) / n  # noqa: E731
        over = sum(r[0] / r[2] - 1 for r in runs) / n
        beats = sum(1 for r in runs if r[0] < r[1])
        crashes = sum(r[3] for r in runs)
        print(f"| {worker.upper()} | {mode} | {mean(0):.2f} | {mean(1):.2f} | {mean(2):.2f} | "
              f"{100 * over:+.1f} % | {beats} of {n} | {crashes} |")
    print()
    print("Every policy's mean average completion time (h) over the seeds:")
    print()
    for worker in workers:
        for mode in modes:
            totals = {}
            for seed in seeds:
                for name, row in summary(run_dir(out, worker, mode, seed)).items():
                    totals.setdefault(name, []).append(hours(row))
            ranked = sorted(totals.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
            listed = ", ".join(f"{name} {sum(v) / len(v):.2f}" for name, v in ranked)
            print(f"- {worker.upper()} `{mode}`: {listed}")


def attribution(out, workers, modes, seeds):
    """How much of the iadeep -> oracle gap (average completion time) each single-part
    oracle closes, per run and as the mean of the runs' shares."""
    print("| data | mode | seed | iadeep CT h | oracle CT h | "
          + " | ".join(f"{p} CT h (gap closed)" for p in PARTS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(PARTS))
    for worker in workers:
        for mode in modes:
            shares = {p: [] for p in PARTS}
            for seed in seeds:
                rows = summary(run_dir(out, worker, mode, seed))
                if not all(p in rows for p in PARTS):
                    continue
                ct, ct_oracle = hours(rows["iadeep"]), hours(rows["oracle"])
                cells = []
                for p in PARTS:
                    part = hours(rows[p])
                    share = (ct - part) / (ct - ct_oracle) if ct > ct_oracle else float("nan")
                    shares[p].append(share)
                    cells.append(f"{part:.2f} ({100 * share:+.0f} %)")
                print(f"| {worker.upper()} | {mode} | {seed} | {ct:.2f} | {ct_oracle:.2f} | "
                      + " | ".join(cells) + " |")
            if all(shares[p] for p in PARTS):
                means = [sum(v) / len(v) for v in (shares[p] for p in PARTS)]
                print(f"| {worker.upper()} | {mode} | mean | | | "
                      + " | ".join(f"{100 * m:+.0f} %" for m in means) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", default="target/release/iadeep", help="the iadeep binary")
    parser.add_argument("--out", default="sim-figures", help="folder for every run's files")
    parser.add_argument("--workers", default="k80,p100")
    parser.add_argument("--modes", default="none,profiled", help="job-information modes")
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--summarise-only", action="store_true",
                        help="print the tables from the runs already in --out")
    parser.add_argument("extra", nargs="*", help="more `iadeep sim` flags, after --")
    args = parser.parse_args()
    workers = args.workers.split(",")
    modes = args.modes.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.summarise_only:
        todo = [(w, m, s) for w in workers for m in modes for s in seeds]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for folder in pool.map(lambda t: simulate(args.bin, args.out, *t, args.extra), todo):
                print(f"done: {folder}", file=sys.stderr)
    table(args.out, workers, modes, seeds)
    print()
    print("The gap attributed (share of the iadeep -> oracle gap in average completion time "
          "that the truth for one part alone closes):")
    print()
    attribution(args.out, workers, modes, seeds)


if __name__ == "__main__":
    main()
