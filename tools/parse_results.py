"""Read accuracies from run folders and average them over seeds (CoOp's parse_test_res.py).

The rules (which log and which line is a run's result, seeds missing or failed, the
population standard deviation) are those of ``experiments/results.py``.

Examples::

    python tools/parse_results.py output/base2new/train_base/dtd/shots_16/CoOp/vit_b16_ctxv1
    python tools/parse_results.py output/base2new --per-run      # every group under a tree
    python tools/parse_results.py output/evaluation --seeds 1 2 3 --kind eval

Exit status: 0 when every experiment has all its seeds' results, 1 (after printing the table)
when a seed is missing or has no result, unless ``--allow-incomplete``; 2 on a bad path.
"""

from __future__ import annotations

import argparse
import os.path as osp
import sys

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401

from experiments.results import KINDS, collect_seeds, find_groups, group_seeds, read_run  # noqa: E402


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", help="run folders, seed-group folders or trees")
    parser.add_argument(
        "--seeds", type=int, nargs="+", help="expected seeds (default: the seed folders found)"
    )
    parser.add_argument("--kind", choices=KINDS, default="auto", help="log kind (default: auto)")
    parser.add_argument("--per-run", action="store_true", help="also list every run")
    parser.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="exit 0 even if an experiment misses seeds or a run has no result (default: the "
        "table is printed and the exit status is 1)",
    )
    args = parser.parse_args(argv)
    from tabulate import tabulate

    rows, runs, bad = [], [], 0
    for path in args.paths:
        if not osp.isdir(path):
            print(f"Error: {path} is not a folder", file=sys.stderr)
            return 2
        groups = find_groups(path)
        if not groups:  # a single run folder
            result = read_run(path, args.kind)
            runs.append((path, result.status, _fmt(result.accuracy), result.detail))
            bad += result.status != "done"
            continue
        for group in groups:
            seed_dirs = group_seeds(group, args.seeds)
            stats = collect_seeds(seed_dirs, args.kind)
            bad += not stats.complete
            std = None if stats.std is None else f"{stats.std:.2f}"
            rows.append((group, _fmt(stats.mean), std or "-", stats.describe()))
            for seed in sorted(seed_dirs):
                result = read_run(seed_dirs[seed], args.kind)
                runs.append((seed_dirs[seed], result.status, _fmt(result.accuracy), result.detail))
    heads = (["experiment", "mean", "std", "seeds"], ["run", "status", "accuracy", "detail"])
    if rows:
        print(tabulate(rows, headers=heads[0], disable_numparse=True))
    if args.per_run or not rows:
        print(tabulate(runs, headers=heads[1], disable_numparse=True))
    if bad:
        print(f"\n{bad} experiment(s) or run(s) incomplete: see the seeds/status columns.")
        if not args.allow_incomplete:
            print(
                f"Error: {bad} experiment(s) or run(s) incomplete (pass --allow-incomplete to "
                "accept partial results)",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
