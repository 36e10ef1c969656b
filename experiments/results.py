"""Read accuracies from run folders and average them over seeds (the library of
``tools/parse_results.py``, CoOp's parse_test_res.py).

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
"""

from __future__ import annotations

import glob
import os
import os.path as osp
import re
import statistics
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
