"""A fresh ``train.py`` process's start-up on a ViT-B/16-shaped CLIP read from a local file
(``tools/benchmark.py --startup``; docs/performance.md, "Where a run's start-up goes").

It writes a random-weight CLIP of the architecture (ViT-B-16 by default: 150 M parameters, a
599 MB fp32 checkpoint) and a DTD-layout dataset (7 classes x 10 images) into a temporary
folder, then runs CoOp processes one after another (1 shot per class, batch 4, one epoch: 2
steps, eager, no test) and reads each one's start-up phases from its ``cost.json``. The first
process finds no record of the CLIP's random initialisation in its fresh ``$SAMPLE_PL_CACHE``
(engine/clip/skip_init.py) and builds it in full; the later ones find it (as every later run of
the same seed and backbone does). Between the runs, ``python -X importtime -c "import train"``
gives what the imports phase is made of (seconds of the modules' own time, by package). The
machine's load average before and after is recorded: on a shared machine compare the phases of
one sitting, not absolute seconds.
"""

from __future__ import annotations

import collections
import json
import os
import os.path as osp
import shutil
import subprocess
import sys
import tempfile
import time

from experiments import ROOT

# the packages the imports phase is reported by (a module counts for the first that prefixes it)
IMPORT_GROUPS = (
    "torch._dynamo",
    "torch._inductor",
    "torch",
    "sympy",
    "triton",
    "torchvision",
    "open_clip",
    "numpy",
    "PIL",
    "ftfy",
    "engine",
    "trainers",
    "optim",
    "datasets",
)


def write_inputs(folder: str, model_cfg: dict) -> tuple[str, str, int]:
    """A random-weight CLIP (``model_cfg``, seed 0) and its config JSON, and the DTD-layout
    dataset, under ``folder``; returns (config path, checkpoint path, checkpoint bytes)."""
    import torch

    from datasets.synthetic import make_dtd
    from engine.clip.model import build_clip, save_clip_checkpoint

    cfg_path, ckpt = osp.join(folder, "clip.json"), osp.join(folder, "clip.pt")
    with open(cfg_path, "w") as f:
        json.dump(model_cfg, f)
    torch.manual_seed(0)
    save_clip_checkpoint(build_clip(model_cfg), ckpt)
    make_dtd(osp.join(folder, "data"))
    return cfg_path, ckpt, osp.getsize(ckpt)


def run_argv(folder: str, cfg_path: str, ckpt: str, out: str, image_size: int) -> list[str]:
    """train.py arguments of the measured run: CoOp, 1 shot x 7 classes, batch 4, one epoch."""
    argv = ["--root", osp.join(folder, "data"), "--seed", "1", "--trainer", "CoOp"]
    argv += ["--dataset-config-file", osp.join(ROOT, "configs/datasets/dtd.yaml")]
    argv += ["--config-file", osp.join(ROOT, "configs/trainers/CoOp/vit_b16_ctxv1.yaml")]
    argv += ["--output-dir", out, "MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path]
    argv += ["MODEL.BACKBONE.PATH", ckpt, "INPUT.SIZE", f"({image_size}, {image_size})"]
    argv += ["TRAINER.COOP.PREC", "fp32", "USE_CUDA", "False", "DATASET.NUM_SHOTS", "1"]
    argv += ["DATALOADER.TRAIN_X.BATCH_SIZE", "4", "DATALOADER.NUM_WORKERS", "0"]
    return argv + ["OPTIM.MAX_EPOCH", "1", "TEST.NO_TEST", "True", "MODEL.COMPILE", "off"]


def import_groups(env: dict) -> dict:
    """Seconds of ``import train`` by package (``python -X importtime``: each module's own
    time), with the total."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import train"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    seconds: dict = collections.Counter()
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, _, name = line[len("import time:") :].split("|")
        name = name.strip()
        group = next((g for g in IMPORT_GROUPS if name == g or name.startswith(g + ".")), "other")
        seconds[group] += int(own) / 1e6
    result = {g: round(seconds[g], 3) for g in (*IMPORT_GROUPS, "other") if g in seconds}
    result["total"] = round(sum(seconds.values()), 3)
    return result


def startup_costs(repeats: int = 3, model_cfg: dict | None = None, image_size: int = 224) -> dict:
    """``repeats`` fresh train.py processes (the first without the CLIP build record) and as
    many import profiles, with the load average around them."""
    if model_cfg is None:
        import open_clip

        model_cfg = dict(open_clip.get_model_config("ViT-B-16"), quick_gelu=True)
    folder = tempfile.mkdtemp(prefix="startup-bench-")
    try:
        cfg_path, ckpt, size = write_inputs(folder, model_cfg)
        env = dict(os.environ, PYTHONPATH=ROOT, SAMPLE_PL_CACHE=osp.join(folder, "cache"))
        result = {"checkpoint_mb": round(size / 1e6, 1), "cpus": os.cpu_count()}
        result["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
        runs, imports = [], []
        for k in range(repeats):
            out = osp.join(folder, f"run{k}")
            argv = run_argv(folder, cfg_path, ckpt, out, image_size)
            records = osp.join(env["SAMPLE_PL_CACHE"], "clip_init")
            known = set(os.listdir(records)) if osp.isdir(records) else set()
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, osp.join(ROOT, "train.py"), *argv],
                capture_output=True,
                text=True,
                env=env,
                cwd=folder,
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"train.py exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
                )
            with open(osp.join(out, "cost.json")) as f:
                cost = json.load(f)
            runs.append(
                {
                    # full: the run recorded its CLIP build; recorded: it found the record
                    "clip_build": "full" if set(os.listdir(records)) - known else "recorded",
                    "time_to_first_step_s": round(cost["startup"]["time_to_first_step_s"], 3),
                    "phases": {p: round(s, 3) for p, s in cost["startup"]["phases"].items()},
                    "wall_s": round(cost["wall_s"], 3),
                    "outside_s": round(time.perf_counter() - t0, 3),
                }
            )
            result["cost_json"] = cost  # the last run's cost.json
            imports.append(import_groups(env))
        result["runs"], result["imports"] = runs, imports
        result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def print_startup_costs(result: dict) -> None:
    print(
        f"Start-up of a fresh train.py process (CoOp, {result['checkpoint_mb']} MB checkpoint, "
        f"{result['cpus']} CPUs, load average {result['load_average_before'][0]} before, "
        f"{result['load_average_after'][0]} after)"
    )
    for run in result["runs"]:
        ph = run["phases"]
        others = max(
            (s, p) for p, s in ph.items() if p not in ("imports", "clip weights", "first step")
        )
        print(
            f"  CLIP build {run['clip_build']:>8}: {run['time_to_first_step_s']:7.2f} s to the "
            f"end of the first step: imports {ph['imports']:.2f}, clip weights "
            f"{ph['clip weights']:.2f}, first step {ph['first step']:.2f}, largest other "
            f"{others[1]} {others[0]:.2f}; imports / clip weights "
            f"{ph['imports'] / max(ph['clip weights'], 1e-9):.1f}"
        )
    for groups in result["imports"]:
        top = sorted(((s, g) for g, s in groups.items() if g != "total"), reverse=True)[:8]
        print(
            f"  import train {groups['total']:.2f} s: " + ", ".join(f"{g} {s:.2f}" for s, g in top)
        )
