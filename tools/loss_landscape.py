"""Loss landscapes around the learned prompts of one or more runs (the paper's Figure 1).

For each run folder written by train.py the trainer is rebuilt in-process from the run's
``config.yaml`` (its output goes to a temporary folder: nothing in the run folder is written),
the checkpoint ``<model>/model.pth.tar-<epoch>`` is loaded and the trainer's own training loss
is evaluated at ``theta + a d1`` (1-D curve) and ``theta + a d1 + b d2`` (2-D surface) around
the learned parameters ``theta``:

- Directions: Gaussian draws from ``--seed`` (the same draws for every run of the same
  architecture), filter-normalised as in Li et al. 2018 ("Visualizing the loss landscape of
  neural nets"): every row of a direction tensor, i.e. every vector along its last dimension
  (a context token of a prompt ``[n_ctx, dim]``, an output unit of a linear layer), is scaled
  to the norm of the same row of the parameter; a 1-D tensor is one row. ``a = 1`` thus moves
  every token by its own norm. The 1-D direction is the first axis of the 2-D plane.
- Parameters: every trainable parameter of the registered (checkpointed) modules, or those
  matching ``--params`` (fnmatch patterns over ``<model>.<parameter>`` names, e.g.
  ``prompt_learner.ctx``; MaPLe/CoPrompt prompts only: ``'*ctx' '*compound_prompts_text*'``).
  They are perturbed in place and restored exactly from copies.
- Loss: the trainer's step protocol, ``prepare_step(parse_batch_train(batch))`` once per batch
  (no grad, the trainer's autocast) and ``compute_loss(inputs)`` at every grid point; the value
  is the batch-size-weighted mean over the first ``--batches`` batches of the training split.
  The batches come from the run's own training loader (its train transform, so trainers that
  need several augmented views get them) at a fixed epoch: with a seeded run (``SEED >= 0``) the
  order and every augmentation are fixed by the run's seed, so runs of the same seed and data
  see identical batches; per-step random draws in ``prepare_step`` use ``--seed``. Modules are in
  eval mode (no dropout), as in Li et al. ``--batches`` counts the run's batches (CoCoOp's
  configs use batch size 1: pass more, or ``-- DATALOADER.TRAIN_X.BATCH_SIZE 32``).
- Scaling: each plot shows loss / (largest |loss| among the compared runs in that plot), as in
  the paper's Figure 1 (``--raw`` plots the losses themselves).

Outputs in ``--out-dir``: ``loss_1d.png`` (all runs), ``loss_2d.png`` (contours, one panel per
run, shared levels), ``loss_3d.png`` (``--surface``) and ``landscape.json`` (the raw losses, grids
and settings; ``--from-json`` redraws the plots from it without recomputing).

Examples::

    python tools/loss_landscape.py RUN_SAM RUN_SAMPLE --out-dir plots/landscape
    python tools/loss_landscape.py RUN --dims 1 --points 41 --radius 0.5 --batches 0 \\
        --params 'prompt_learner.ctx' -- DATASET.ROOT /data DATALOADER.NUM_WORKERS 4
    python tools/loss_landscape.py --from-json plots/landscape/landscape.json --surface

Options after ``--`` are KEY VALUE config overrides for every run (e.g. ``DATASET.ROOT`` when
the data moved; ``--root`` is a shortcut for it).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import math
import os.path as osp
import sys
import tempfile

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from experiments.plotting import (  # noqa: E402
    mark_identical,
    optimizer_name,
    pyplot,
    read_run_config,
    run_colors,
    run_labels,
    save_figure,
    write_json,
)

JSON_NAME = "landscape.json"


# -- the trainer of a run ---------------------------------------------------------------------
def run_cfg(run_dir: str, output_dir: str, opts: list[str] | tuple[str, ...] = ()):
    """The run's config as train.py merged it, writing to ``output_dir``, with ``opts`` on top."""
    import datasets  # noqa: F401  (registers the readers, as train.py does)
    import trainers  # noqa: F401  (registers the trainers and their config keys)
    from engine.config import get_cfg_default, merge_from_file, merge_from_list

    cfg = get_cfg_default()
    merge_from_file(cfg, osp.join(run_dir, "config.yaml"))
    cfg.OUTPUT_DIR = output_dir
    cfg.RESUME = ""
    merge_from_list(cfg, list(opts), source="the options after --")
    cfg.freeze()
    return cfg


def load_run_trainer(run_dir: str, output_dir: str, epoch: int | None = None, opts=()):
    """Rebuild a run's trainer, set up for training, with the weights of ``epoch`` loaded.

    Args:
        run_dir: a train.py run folder (``config.yaml`` and ``<model>/model.pth.tar-<E>``).
        output_dir: where the trainer may write (a temporary folder; not ``run_dir``).
        epoch: the checkpoint epoch (default: the run's ``OPTIM.MAX_EPOCH``).
        opts: KEY VALUE config overrides.
    """
    from engine import build_trainer
    from engine.utils import set_random_seed
    from experiments.protocols import load_epoch

    if osp.abspath(output_dir) == osp.abspath(run_dir):
        raise ValueError("output_dir must not be the run folder (it would be written to)")
    cfg = run_cfg(run_dir, output_dir, opts)
    if epoch is None:
        epoch = load_epoch(run_dir)
    if cfg.SEED >= 0:
        set_random_seed(cfg.SEED)
    trainer = build_trainer(cfg)
    try:
        trainer.before_train()  # training-time state (e.g. CoPrompt's descriptions); no resume
    finally:
        trainer.close_writer()
    trainer.load_model(run_dir, epoch=epoch)
    trainer.set_model_mode("eval")
    return trainer, epoch


def learnable_parameters(trainer, patterns: list[str] | None = None) -> dict[str, torch.Tensor]:
    """``{"<model>.<name>": parameter}``: trainable parameters of the registered modules.

    Args:
        patterns: fnmatch patterns selecting names (default: all).
    """
    params = {}
    for model_name in trainer.get_model_names():
        module = trainer.get_model(model_name)
        for name, p in module.named_parameters():
            if p.requires_grad:
                params[f"{model_name}.{name}"] = p
    if not params:
        raise ValueError(f"{type(trainer).__name__} registers no trainable parameters to perturb")
    if patterns:
        chosen = {
            n: p for n, p in params.items() if any(fnmatch.fnmatch(n, pat) for pat in patterns)
        }
        if not chosen:
            raise ValueError(
                f"--params {' '.join(patterns)} matches no parameter; names: {', '.join(params)}"
            )
        params = chosen
    return dict(sorted(params.items()))


# -- directions -------------------------------------------------------------------------------
def filter_normalize(direction: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Scale every row of ``direction`` to the norm of the same row of ``param`` (Li et al.).

    Rows are the vectors along the last dimension; a 0-d or 1-d tensor is a single row.
    """
    if direction.shape != param.shape:
        raise ValueError(f"direction {tuple(direction.shape)} vs parameter {tuple(param.shape)}")
    width = param.shape[-1] if param.dim() >= 2 else max(param.numel(), 1)
    d_rows = direction.float().reshape(-1, width)  # [rows, width]
    p_rows = param.detach().float().reshape(-1, width)  # [rows, width]
    scale = p_rows.norm(dim=1, keepdim=True) / d_rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return (d_rows * scale).reshape(param.shape)


def random_directions(params: dict[str, torch.Tensor], count: int, seed: int) -> list[dict]:
    """``count`` filter-normalised Gaussian directions, drawn on the CPU from ``seed`` in the
    sorted order of the parameter names (the same draws for every run of an architecture)."""
    generator = torch.Generator().manual_seed(seed)
    directions = []
    for _ in range(count):
        d = {}
        for name in sorted(params):
            p = params[name]
            draw = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            d[name] = filter_normalize(draw, p.detach().cpu()).to(p.device)
        directions.append(d)
    return directions


@contextlib.contextmanager
def perturbation(params: dict[str, torch.Tensor]):
    """Yield ``move(coords, directions)`` setting ``theta + sum_i coords[i] directions[i]``;
    the parameters are restored exactly (from copies) on exit."""
    origin = {n: p.detach().clone() for n, p in params.items()}

    def move(coords, directions) -> None:
        with torch.no_grad():
            for n, p in params.items():
                value = origin[n].float()
                for c, d in zip(coords, directions):
                    value = value + float(c) * d[n]
                p.copy_(value.to(p.dtype))

    try:
        yield move
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(origin[n])


# -- the loss ---------------------------------------------------------------------------------
def prepare_batches(trainer, num_batches: int, seed: int = 0, epoch: int = 0) -> list:
    """``[(inputs, weight)]``: the first ``num_batches`` training batches (0 = all) of the
    loader at ``epoch``, each through ``prepare_step(parse_batch_train(batch))`` once."""
    loader = trainer.train_loader_x
    if loader is None:
        raise ValueError("The run's dataset has no training split to evaluate the loss on")
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    prepared = []
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # random draws of prepare_step (and of unseeded augmentation)
        for batch in loader:
            if num_batches and len(prepared) >= num_batches:
                break
            weight = len(batch["label"]) if isinstance(batch, dict) and "label" in batch else 1
            parsed = trainer.parse_batch_train(batch)
            with torch.no_grad(), trainer.autocast():
                prepared.append((trainer.prepare_step(parsed), weight))
    if not prepared:
        raise ValueError("The training loader yielded no batch")
    return prepared


def mean_loss(trainer, batches: list) -> float:
    """The batch-size-weighted mean of ``trainer.compute_loss`` over prepared batches."""
    losses, total = [], 0
    with torch.no_grad():
        for inputs, weight in batches:
            with trainer.autocast():
                out = trainer.compute_loss(inputs)
            loss = out[0] if isinstance(out, tuple) else out
            losses.append(loss.detach().float().reshape(()) * weight)
            total += weight
    return float(torch.stack(losses).sum()) / total


def scan(trainer, params, directions, coords, batches, desc: str = "") -> np.ndarray:
    """The mean loss at ``theta + sum_i c_i d_i`` for every ``c`` in ``coords`` ``[n, k]``."""
    values = np.empty(len(coords))
    with perturbation(params) as move:
        for i, c in enumerate(tqdm(coords, desc=desc, leave=False, disable=None)):
            move(c, directions)
            values[i] = mean_loss(trainer, batches)
    return values


def axis(radius: float, points: int) -> np.ndarray:
    """``points`` coordinates in ``[-radius, radius]`` (0 exactly when ``points`` is odd)."""
    if points < 2:
        raise ValueError(f"--points must be >= 2, got {points}")
    if radius <= 0:
        raise ValueError(f"--radius must be > 0, got {radius}")
    values = np.linspace(-radius, radius, points)
    if points % 2:
        values[points // 2] = 0.0
    return values


def landscape(trainer, params, directions, batches, dims, alphas_1d, alphas_2d, label=""):
    """``{"loss_origin", "loss_1d" [n], "loss_2d" [n, n] (rows: d1, columns: d2)}``."""
    out = {"loss_origin": mean_loss(trainer, batches)}
    if 1 in dims:
        coords = [(a,) for a in alphas_1d]
        out["loss_1d"] = scan(trainer, params, directions[:1], coords, batches, f"{label} 1-D")
    if 2 in dims:
        coords = [(a, b) for a in alphas_2d for b in alphas_2d]
        values = scan(trainer, params, directions[:2], coords, batches, f"{label} 2-D")
        out["loss_2d"] = values.reshape(len(alphas_2d), len(alphas_2d))  # [n_d1, n_d2]
    return out


def compute(args) -> dict:
    """Rebuild every run, scan its landscape and return the JSON-ready results."""
    labels = run_labels(args.runs, args.labels)
    alphas_1d = axis(args.radius, args.points)
    alphas_2d = axis(args.radius, args.points_2d)
    opts = (["DATASET.ROOT", args.root] if args.root else []) + list(args.opts)
    result = {
        "seed": args.seed,
        "radius": args.radius,
        "batches": args.batches,
        "params": args.params or ["*"],
        "dims": sorted(args.dims),
        "alphas_1d": alphas_1d.tolist(),
        "alphas_2d": alphas_2d.tolist(),
        "runs": [],
    }
    for run_dir, label in zip(args.runs, labels):
        with tempfile.TemporaryDirectory(prefix="loss-landscape-") as tmp:
            trainer, epoch = load_run_trainer(run_dir, tmp, args.epoch, opts)
            params = learnable_parameters(trainer, args.params)
            directions = random_directions(params, 2, args.seed)
            batches = prepare_batches(trainer, args.batches, args.seed)
            values = landscape(
                trainer, params, directions, batches, args.dims, alphas_1d, alphas_2d, label
            )
        n = sum(w for _, w in batches)
        print(f"{label}: loss {values['loss_origin']:.4f} at epoch {epoch} ({n} samples)")
        entry = {
            "run_dir": run_dir,
            "label": label,
            "optim": optimizer_name(read_run_config(run_dir)),
            "epoch": epoch,
            "samples": n,
            "parameters": {k: list(p.shape) for k, p in params.items()},
        }
        entry.update({k: np.asarray(v).tolist() for k, v in values.items()})
        result["runs"].append(entry)
    return result


# -- plots ------------------------------------------------------------------------------------
def plot_scale(runs: list[dict], key: str, raw: bool) -> float:
    """The divisor of a plot: the largest finite |loss| among the runs (1 with ``raw``)."""
    if raw:
        return 1.0
    values = np.abs(np.concatenate([np.ravel(r[key]) for r in runs]))
    values = values[np.isfinite(values)]
    if not len(values) or values.max() == 0:
        raise ValueError(f"No finite non-zero {key} values to scale by: every loss is NaN/inf/0")
    return float(values.max())


def _ylabel(scale: float) -> str:
    return "loss" if scale == 1.0 else f"loss / {scale:.4g} (max among runs)"


def figure_1d(result: dict, raw: bool = False):
    """The 1-D plot's figure: one curve per run; a curve identical to an earlier one is dashed
    and its legend entry says so (:func:`tools.plotting.mark_identical`)."""
    plt = pyplot()
    runs = result["runs"]
    scale = plot_scale(runs, "loss_1d", raw)
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = run_colors([r.get("optim", "") for r in runs])
    curves = [np.asarray(r["loss_1d"]) / scale for r in runs]
    labels, styles = mark_identical([r["label"] for r in runs], curves)
    for y, label, style, color in zip(curves, labels, styles, colors):
        ax.plot(result["alphas_1d"], y, label=label, lw=2, color=color, ls=style)
    ax.axvline(0.0, color="k", lw=0.5, ls=":")
    ax.set_xlabel("step along a filter-normalised random direction")
    ax.set_ylabel(_ylabel(scale))
    if scale != 1.0:  # the losses themselves on the right
        right = ax.secondary_yaxis("right", functions=(lambda v: v * scale, lambda v: v / scale))
        right.set_ylabel("loss")
    ax.set_title("Training loss around the learned prompts")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def plot_1d(result: dict, path: str, raw: bool = False) -> str:
    return save_figure(figure_1d(result, raw), path)


def figure_2d(result: dict, raw: bool = False):
    """The 2-D contour panels' figure: shared axes (the directions' scale is the same in every
    panel), labelled once per row and column, laid out so that no labels overlap."""
    plt = pyplot()
    runs = result["runs"]
    scale = plot_scale(runs, "loss_2d", raw)
    a = np.asarray(result["alphas_2d"])
    x, y = np.meshgrid(a, a, indexing="ij")  # [n_d1, n_d2], as loss_2d
    surfaces = [np.asarray(r["loss_2d"]) / scale for r in runs]
    finite = np.concatenate([s[np.isfinite(s)] for s in surfaces])
    levels = np.linspace(finite.min(), finite.max(), 21) if np.ptp(finite) > 0 else 21
    cols = min(len(runs), 3)
    rows = math.ceil(len(runs) / cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(4.2 * cols + 1.0, 3.8 * rows),
        squeeze=False,
        sharex=True,
        sharey=True,
        layout="constrained",
    )
    titles, _ = mark_identical([r["label"] for r in runs], surfaces)
    for k, (ax, title, z) in enumerate(zip(axes.flat, titles, surfaces)):
        filled = ax.contourf(x, y, z, levels=levels, cmap="viridis")
        ax.contour(x, y, z, levels=levels, colors="k", linewidths=0.3)
        ax.plot(0, 0, "w+", ms=10)
        ax.set_title(title, fontsize=10)
        if k // cols == rows - 1 or k + cols >= len(runs):  # the lowest panel of its column
            ax.set_xlabel("direction 1")
        if k % cols == 0:
            ax.set_ylabel("direction 2")
        else:
            ax.tick_params(labelleft=False)
        ax.set_aspect("equal")
    for ax in list(axes.flat)[len(runs) :]:
        ax.set_visible(False)
    fig.colorbar(filled, ax=axes.ravel().tolist(), label=_ylabel(scale))
    return fig


def plot_2d(result: dict, path: str, raw: bool = False) -> str:
    return save_figure(figure_2d(result, raw), path)


def plot_3d(result: dict, path: str, raw: bool = False) -> str:
    plt = pyplot()
    runs = result["runs"]
    scale = plot_scale(runs, "loss_2d", raw)
    a = np.asarray(result["alphas_2d"])
    x, y = np.meshgrid(a, a, indexing="ij")  # [n_d1, n_d2]
    surfaces = [np.asarray(r["loss_2d"]) / scale for r in runs]
    finite = np.concatenate([s[np.isfinite(s)] for s in surfaces])
    fig = plt.figure(figsize=(4.5 * len(runs), 4.2))
    for i, (r, z) in enumerate(zip(runs, surfaces)):
        ax = fig.add_subplot(1, len(runs), i + 1, projection="3d")
        ax.plot_surface(x, y, z, cmap="viridis", vmin=finite.min(), vmax=finite.max())
        ax.set_zlim(finite.min(), finite.max())
        ax.set_title(r["label"])
        ax.set_xlabel("dir. 1")
        ax.set_ylabel("dir. 2")
        ax.set_zlabel(_ylabel(scale) if i == 0 else "")
    return save_figure(fig, path)


def plot_all(result: dict, out_dir: str, surface: bool, raw: bool) -> list[str]:
    """Draw the plots the results allow; returns the PNG paths."""
    paths = []
    runs = result["runs"]
    if runs and all("loss_1d" in r for r in runs):
        paths.append(plot_1d(result, osp.join(out_dir, "loss_1d.png"), raw))
    if runs and all("loss_2d" in r for r in runs):
        paths.append(plot_2d(result, osp.join(out_dir, "loss_2d.png"), raw))
        if surface:
            paths.append(plot_3d(result, osp.join(out_dir, "loss_3d.png"), raw))
    return paths


# -- command line -----------------------------------------------------------------------------
def bad_input_errors() -> tuple:
    """Errors that mean bad input (config, data, registry, checkpoint, weights): one line."""
    from engine.clip import BackboneError

    return (ValueError, FileNotFoundError, KeyError, BackboneError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="*", help="train.py run folders to compare")
    parser.add_argument("--labels", nargs="+", help="legend labels (default: Trainer+optimizer)")
    parser.add_argument(
        "--out-dir", default="landscape", help="folder of the PNGs and JSON (default landscape)"
    )
    parser.add_argument(
        "--dims", nargs="+", type=int, choices=(1, 2), default=[1, 2], help="default: 1 2"
    )
    parser.add_argument("--points", type=int, default=21, help="1-D grid points (default 21)")
    parser.add_argument(
        "--points-2d", type=int, default=11, help="2-D grid points per axis (default 11)"
    )
    parser.add_argument("--radius", type=float, default=1.0, help="grid half-width (default 1)")
    parser.add_argument(
        "--batches", type=int, default=4, help="training batches per loss (0 = all; default 4)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the directions (default 0)")
    parser.add_argument("--epoch", type=int, help="checkpoint epoch (default: OPTIM.MAX_EPOCH)")
    parser.add_argument("--params", nargs="+", help="fnmatch patterns of parameters to perturb")
    parser.add_argument("--surface", action="store_true", help="also draw 3-D surfaces")
    parser.add_argument("--raw", action="store_true", help="plot raw losses (no scaling)")
    parser.add_argument("--root", default="", help="dataset root (DATASET.ROOT) if it moved")
    parser.add_argument("--from-json", help=f"redraw the plots from a saved {JSON_NAME}")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from tools.grid import split_opts

    argv, opts = split_opts(argv)
    args = build_parser().parse_args(argv)
    args.opts = opts
    try:
        if args.from_json:
            import json

            with open(args.from_json) as f:
                result = json.load(f)
        else:
            if not args.runs:
                raise ValueError("Give one or more run folders (or --from-json FILE)")
            result = compute(args)
            print(f"raw losses: {write_json(result, osp.join(args.out_dir, JSON_NAME))}")
        for path in plot_all(result, args.out_dir, args.surface, args.raw):
            print(f"wrote {path}")
    except Exception as e:
        if not isinstance(e, bad_input_errors()):
            raise
        print(f"Error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
