"""The experiment library: protocols and their run folders, grid plans and their execution
(locally, packed workers, SLURM), results, statistics, tables, the report, plots, benchmarks
and the data checks. The commands that use it are in ``tools/``."""

import os.path as osp

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
