"""Read accuracies from run folders and average them over seeds (CoOp's parse_test_res.py).

A run folder holds ``log.txt`` and, after each resume, ``log.txt-YYYY-mm-dd-HH-MM-SS`` files
(Dassl's naming, so name order is time order). The result of a log is the last
``* accuracy: X%`` line after the first ``Finish training`` line (training runs; CoOp-era logs
say ``Finished training``) or after the first ``=> result`` line (``--eval-only`` runs, which log
``eval_only: True``). The result of a run is that of its NEWEST log that has one: a resumed
training run ends with a log that holds the final test, and a later attempt that crashed
does not hide a finished result.

Seed averages are means with the population standard deviation (numpy's default, as in CoOp);
seeds without a folder are reported as missing and seeds whose folder has no result as failed,
never silently dropped.

Examples::

    python tools/parse_results.py output/base2new/train_base/dtd/shots_16/CoOp/vit_b16_ctxv1
    python tools/parse_results.py output/base2new --per-run      # every group under a tree
    python tools/parse_results.py output/evaluation --seeds 1 2 3 --kind eval

Exit status: 0 when every experiment has all its seeds' results, 1 (after printing the table)
when a seed is missing or has no result, unless ``--allow-incomplete``; 2 on a bad path.
"""

from __future__ import annotations

import argparse
import glob
import os
import os.path as osp
import re
import statistics
import sys
from dataclasses import dataclass, field

ACCURACY_RE = re.compile(r"\* accuracy: ([\.\deE+-]+)%")
TRAIN_END_RE = re.compile(r"Finish(?:ed)? training")
RESULT_RE = re.compile(r"=> result\b")
EVAL_ONLY_RE = re.compile(r"^eval_only: (True|False)\s*$", re.MULTILINE)
SEED_DIR_RE = re.compile(r"^seed(\d+)$")
KINDS = ("auto", "train", "eval")


@dataclass
class RunResult:
    """The result of one run folder.

    Attributes:
        run_dir: the folder.
        status: ``done`` (a result line was found), ``no_result`` (the folder exists but no log
            holds a result: interrupted, running or failed) or ``missing`` (no folder).
        accuracy: the accuracy in percent (``done`` only).
        log: the log file the result was read from.
        detail: for ``no_result``, what was found instead.
    """

    run_dir: str
    status: str
    accuracy: float | None = None
    log: str | None = None
    detail: str = ""


@dataclass
class SeedStats:
    """One experiment's results over its seeds.

    Attributes:
        values: ``{seed: accuracy}`` of the seeds with a result.
        missing: seeds without a run folder.
        failed: seeds whose folder holds no result.
    """

    values: dict[int, float] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def expected(self) -> int:
        return len(self.values) + len(self.missing) + len(self.failed)

    @property
    def complete(self) -> bool:
        return self.n > 0 and not self.missing and not self.failed

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values.values()) if self.values else None

    @property
    def std(self) -> float | None:
        return statistics.pstdev(self.values.values()) if self.values else None

    def describe(self) -> str:
        """``"3/3 seeds"`` or ``"2/3 seeds; missing seed3; failed seed2"``."""
        text = f"{self.n}/{self.expected} seeds"
        if self.missing:
            text += "; missing " + ", ".join(f"seed{s}" for s in self.missing)
        if self.failed:
            text += "; no result " + ", ".join(f"seed{s}" for s in self.failed)
        return text


def log_files(run_dir: str) -> list[str]:
    """The run's log files, oldest first (``log.txt``, then the timestamped ones)."""
    first = osp.join(run_dir, "log.txt")
    later = sorted(p for p in glob.glob(first + "-*") if osp.isfile(p))
    return ([first] if osp.isfile(first) else []) + later


def log_kind(text: str) -> str:
    """``eval`` for an ``--eval-only`` log, else ``train``."""
    m = EVAL_ONLY_RE.search(text)
    if m:
        return "eval" if m.group(1) == "True" else "train"
    return "train" if TRAIN_END_RE.search(text) else "eval"


def parse_log(text: str, kind: str = "auto") -> float | None:
    """The accuracy a log reports, or None.

    Args:
        text: the log's content.
        kind: ``train`` (result after ``Finish(ed) training``), ``eval`` (after ``=> result``)
            or ``auto`` (decided by the logged ``eval_only`` argument).
    """
    if kind not in KINDS:
        raise ValueError(f"Unknown log kind {kind!r}: use one of {KINDS}")
    if kind == "auto":
        kind = log_kind(text)
    marker = (TRAIN_END_RE if kind == "train" else RESULT_RE).search(text)
    if marker is None:
        return None
    found = ACCURACY_RE.findall(text, marker.end())
    return float(found[-1]) if found else None


def read_run(run_dir: str, kind: str = "auto") -> RunResult:
    """The result of one run folder (the newest log with a result wins)."""
    if not osp.isdir(run_dir):
        return RunResult(run_dir, "missing", detail="no folder")
    logs = log_files(run_dir)
    if not logs:
        return RunResult(run_dir, "no_result", detail="no log.txt")
    for path in reversed(logs):
        with open(path, errors="replace") as f:
            acc = parse_log(f.read(), kind)
        if acc is not None:
            return RunResult(run_dir, "done", acc, path)
    with open(logs[-1], errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    last = lines[-1][:120] if lines else "(empty)"
    return RunResult(
        run_dir, "no_result", detail=f"no result in {len(logs)} log file(s); last line: {last}"
    )


def collect_seeds(seed_dirs: dict[int, str], kind: str = "auto") -> SeedStats:
    """Results of ``{seed: run folder}`` as :class:`SeedStats`."""
    stats = SeedStats()
    for seed in sorted(seed_dirs):
        result = read_run(seed_dirs[seed], kind)
        if result.status == "done":
            stats.values[seed] = result.accuracy
        elif result.status == "missing":
            stats.missing.append(seed)
        else:
            stats.failed.append(seed)
    return stats


def find_groups(path: str) -> list[str]:
    """Folders under ``path`` (itself included) that hold ``seed<N>`` run folders."""
    groups = []
    for dirpath, dirnames, _ in os.walk(path):
        if any(SEED_DIR_RE.match(d) for d in dirnames):
            groups.append(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not SEED_DIR_RE.match(d))
    return sorted(groups)


def group_seeds(group: str, seeds: list[int] | None) -> dict[int, str]:
    """``{seed: folder}`` for the expected ``seeds`` (or every seed folder found)."""
    found = {
        int(m.group(1)): osp.join(group, d)
        for d in os.listdir(group)
        if (m := SEED_DIR_RE.match(d)) and osp.isdir(osp.join(group, d))
    }
    if seeds is None:
        return found
    return {s: found.get(s, osp.join(group, f"seed{s}")) for s in seeds}


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
