"""The SAMPLe paper's result tables, kept as data (``experiments/paper_results.csv``).

The CSV has one row per published number: ``table,trainer,optimizer,dataset,metric,value``.

- ``table``: ``base2new`` (Table "full comparison": 12 panels, metrics ``base``/``new``/``hm``),
  ``cross_dataset`` and ``domain_gen`` (metric ``acc``; dataset ``imagenet`` is the source
  column, ``average`` the "Avg" column), ``ablation`` (the term-wise ablation: CoPrompt, average
  of the 11 datasets; ``sgd`` = L, ``sam`` = L_p, ``sagm`` = the SAGM objective, ``sample`` =
  the full SAMPLe objective).
- ``trainer``: registry names (the paper's "MAPLe" is ``MaPLe``); ``optimizer``: ``sgd`` for the
  plain method row (whatever base optimizer the trainer uses), ``sam``, ``fsam``, ``sagm``,
  ``sample``; ``dataset``: config stems (``configs/datasets/<stem>.yaml``) or ``average``.

The SAMPLe paper's numbers were read from the LaTeX source in
``../shared/paper/`` by position (panel order, 5 trainers x 5 rows each) and checked by hand
and by ``tests/test_results.py``. Known inconsistencies of the paper itself, kept as printed:

- The "Average" panel's HM of the +SAM/+FSAM/+SAGM/+SAMPLe rows of CoOp, CoCoOp, MaPLe and
  CoPrompt is the mean of the per-dataset HMs, while the baseline rows and TCP use the HM of the
  averaged Base and New (this project's convention, as in CoCoOp/MaPLe); ``make_tables.py
  --avg-hm mean-of-hms`` reproduces the other convention.
- Two "Average" HMs match neither convention: CoOp+SAM 76.07 (mean of the HMs 76.18, HM of the
  means 76.54) and TCP+FSAM 79.83 (79.69 / 79.91).
- TCP's +FSAM/+SAGM/+SAMPLe average Base (84.02/86.97/87.52) is not the mean of the 11
  per-dataset values (84.11/85.15/85.70).
- Cross-dataset "Avg" of CoPrompt+SAMPLe (67.95; mean of the 10 targets 66.85) and TCP+SAMPLe
  (67.53; mean 67.43); domain generalization "Avg" of CoOp+SAMPLe (60.41; mean 60.51).
- A few per-dataset HMs differ from 2BN/(B+N) by up to 0.11 (rounding in the paper).
- TCP's ImageNet source accuracy is 71.40 in the cross-dataset table and 71.20 in the domain
  generalization table; CoCoOp+SAMPLe's is printed "71,03" (read as 71.03).

Trainers the SAMPLe paper does not have take their comparison column from their own papers (or
later papers' reprints of them): one CSV per source in ``experiments/published/``
(:func:`load_published_results`, read by :func:`paper_value` after this file), optimizer
``sgd`` for the published method row. They
hold DePT's tables (``dept.csv``: base-to-new per dataset, cross-dataset, domain
generalisation), ProGrad's (``prograd.csv``: Zhu et al., ICCV 2023), MMRL's (``mmrl.csv``: Guo
and Gu, CVPR 2025) and SkipTuning's (``skiptuning.csv``: Wu et al., CVPR 2025); all ViT-B/16,
16 shots. Lines starting with ``#`` are comments: each file's header names where its numbers
come from (SkipTuning's and ProGrad's: the tables in SkipTuning's README; MMRL's: the tables of
later papers that print MMRL's rows) and which cells no source gives (absent, so ``None``).
``tests/test_published.py`` checks every row's HM against its Base and New and the averages
against the rows.

The base-to-new "Average" cells among these are data too (:data:`AVERAGE_INCONSISTENCIES`, pinned
by tests/test_repro.py against the CSV).
"""

from __future__ import annotations

import csv
import os.path as osp
from functools import lru_cache

PAPER_CSV = osp.join(osp.dirname(osp.abspath(__file__)), "paper_results.csv")

TABLES = ("base2new", "cross_dataset", "domain_gen", "ablation")
TRAINERS = ("CoOp", "CoCoOp", "MaPLe", "CoPrompt", "TCP")
# trainers the paper has no numbers for (their tables have no paper column; tools/grid.py's
# "extra" presets)
EXTRA_TRAINERS = ("KgCoOp", "IVLP", "PromptSRC", "ProGrad", "MMRL", "SkipTuning")
OPTIMIZERS = ("sgd", "sam", "fsam", "sagm", "sample")
BASE2NEW_DATASETS = (
    "imagenet",
    "caltech101",
    "oxford_pets",
    "stanford_cars",
    "oxford_flowers",
    "food101",
    "fgvc_aircraft",
    "sun397",
    "dtd",
    "eurosat",
    "ucf101",
)
CROSS_DATASET_TARGETS = BASE2NEW_DATASETS[1:]
DOMAIN_GEN_TARGETS = ("imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r")
TARGETS_BY_TABLE = {"cross_dataset": CROSS_DATASET_TARGETS, "domain_gen": DOMAIN_GEN_TARGETS}

# column / panel titles as the paper prints them
DATASET_TITLES = {
    "average": "Average",
    "imagenet": "ImageNet",
    "caltech101": "Caltech101",
    "oxford_pets": "OxfordPets",
    "stanford_cars": "StanfordCars",
    "oxford_flowers": "Flowers102",
    "food101": "Food101",
    "fgvc_aircraft": "FGVCAircraft",
    "sun397": "SUN397",
    "dtd": "DTD",
    "eurosat": "EuroSAT",
    "ucf101": "UCF101",
    "imagenetv2": "ImageNet-V2",
    "imagenet_sketch": "ImageNet-S",
    "imagenet_a": "ImageNet-A",
    "imagenet_r": "ImageNet-R",
}
OPTIMIZER_TITLES = {"sgd": "", "sam": "+SAM", "fsam": "+FSAM", "sagm": "+SAGM", "sample": "+SAMPLe"}
# the cheaper sharpness-aware optimizers (docs/efficient-sharpness.md); not in the paper
OPTIMIZER_TITLES |= {
    "looksam": "+LookSAM",
    "sample_k5": "+SAMPLe-k5",
    "esam": "+ESAM",
    "rwp": "+RWP",
    "mrwp": "+m-RWP",
    "saf": "+SAF",
    "mesa": "+MESA",
}


# The cheaper sharpness-aware optimizers beside SGD, SAM and SAMPLe in the paper's protocols
# (docs/efficient-sharpness.md); "sample_k5" is SAMPLe with a lookahead of 5 (OPTIM.SAM.EVERY)
EFFICIENT_OPTIMIZERS = (
    "sgd",
    "sam",
    "sample",
    "looksam",
    "sample_k5",
    "esam",
    "rwp",
    "mrwp",
    "saf",
    "mesa",
)


MODE_SEP = "@"  # "sample@released": an optimizer row of one reproduction mode (make_tables.py)


def with_mode(optimizer: str, mode: str | None) -> str:
    """The row key of ``optimizer`` in reproduction mode ``mode`` (None: no mode label)."""
    return optimizer if not mode else f"{optimizer}{MODE_SEP}{mode}"


def split_mode(optimizer: str) -> tuple[str, str | None]:
    """Inverse of :func:`with_mode`: ``"sample@released"`` -> ``("sample", "released")``."""
    name, sep, mode = optimizer.partition(MODE_SEP)
    return name, (mode if sep else None)


# Base-to-new "Average" cells that do not follow from the paper's own per-dataset numbers:
# (trainer, optimizer, metric, printed, mean of the 11 per-dataset values, HM of the mean Base and
# mean New). For "base"/"new" only the mean applies (None for the HM column).
AVERAGE_INCONSISTENCIES = (
    ("CoOp", "sam", "hm", 76.07, 76.18, 76.54),
    ("TCP", "fsam", "hm", 79.83, 79.69, 79.91),
    ("TCP", "fsam", "base", 84.02, 84.11, None),
    ("TCP", "sagm", "base", 86.97, 85.15, None),
    ("TCP", "sample", "base", 87.52, 85.70, None),
)


def average_conventions(trainer: str, optimizer: str, metric: str) -> tuple[float, float | None]:
    """``(mean of the 11 per-dataset values, HM of the mean Base and New or None)`` of a
    base-to-new "Average" cell, recomputed from the paper's per-dataset numbers."""
    values = load_paper_results()

    def mean(m):
        return sum(values[("base2new", trainer, optimizer, d, m)] for d in BASE2NEW_DATASETS) / 11

    if metric != "hm":
        return mean(metric), None
    base, new = mean("base"), mean("new")
    return mean("hm"), 2 * base * new / (base + new)


ZERO_SHOT = ("CLIP", "zeroshot")  # the zero-shot CLIP row of the tables (make_tables --zeroshot)


def row_title(trainer: str, optimizer: str) -> str:
    """The paper's row label: ``CoOp`` for the plain method, ``CoOp+SAMPLe`` otherwise; a row of
    a reproduction mode (``sample@released``) ends with the mode: ``CoOp+SAMPLe [released]``;
    :data:`ZERO_SHOT` is ``Zero-shot CLIP``."""
    if (trainer, optimizer) == ZERO_SHOT:
        return "Zero-shot CLIP"
    name, mode = split_mode(optimizer)
    title = trainer + OPTIMIZER_TITLES.get(name, f"+{name}")
    return f"{title} [{mode}]" if mode else title


@lru_cache(maxsize=4)
def load_paper_results(path: str = PAPER_CSV) -> dict[tuple[str, str, str, str, str], float]:
    """Read the paper's numbers.

    Args:
        path: the CSV file (default: ``experiments/paper_results.csv``); lines starting with
            ``#`` are comments (where the numbers come from), skipped.

    Returns:
        ``{(table, trainer, optimizer, dataset, metric): value}``.

    Raises:
        ValueError: a row is malformed or a key appears twice.
    """
    out: dict[tuple[str, str, str, str, str], float] = {}
    with open(path, newline="") as f:
        kept = [n for n, line in enumerate(f, start=1) if not line.startswith("#")]
        f.seek(0)
        reader = csv.DictReader(line for line in f if not line.startswith("#"))
        for row in reader:
            lineno = kept[reader.line_num - 1]  # the file's line number, comments counted
            try:
                key = tuple(row[k] for k in ("table", "trainer", "optimizer", "dataset", "metric"))
                value = float(row["value"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: malformed row {row} ({e})") from e
            if key[0] not in TABLES:
                raise ValueError(f"{path}:{lineno}: unknown table {key[0]!r} (one of {TABLES})")
            if key in out:
                raise ValueError(f"{path}:{lineno}: duplicate entry {key}")
            out[key] = value
    return out


# Other papers' published numbers of the trainers the SAMPLe paper does not cover (e.g. DePT's
# own tables for DePT_CoOp ...): one CSV per source in experiments/published/, the columns of
# paper_results.csv; they give those trainers' rows their comparison column
PUBLISHED_DIR = osp.join(osp.dirname(osp.abspath(__file__)), "published")


@lru_cache(maxsize=4)
def load_published_results(folder: str = PUBLISHED_DIR) -> dict[tuple, float]:
    """Every CSV of ``folder`` (:data:`PUBLISHED_DIR`) read as :func:`load_paper_results`; a key
    in two files, or one that the SAMPLe paper's file also holds, is an error."""
    import glob

    out: dict[tuple, float] = {}
    paper = load_paper_results()
    for path in sorted(glob.glob(osp.join(folder, "*.csv"))):
        for key, value in load_paper_results(path).items():
            if key in out or key in paper:
                raise ValueError(f"{path}: {key} is published twice (another file holds it)")
            out[key] = value
    return out


def paper_value(
    table: str, trainer: str, optimizer: str, dataset: str, metric: str = "acc"
) -> float | None:
    """One published number, or None where the paper has no such cell (any reproduction mode's
    row is compared with the published number); trainers the SAMPLe paper has no numbers for
    take their own paper's (:func:`load_published_results`)."""
    optimizer = split_mode(optimizer)[0]
    key = (table, trainer, optimizer, dataset, metric)
    value = load_paper_results().get(key)
    return value if value is not None else load_published_results().get(key)
