"""Bytes a data-parallel run all-reduces per step, per trainer (docs/distributed.md).

Builds each trainer from its published config on a random-weight CLIP of ViT-B/16's shape (no
weights or data needed: the learnable tensors' sizes are those of the real model) and counts
the numbers the gradient sync (optim/distributed.py) all-reduces per pass: every learnable
number, one has-gradient flag per tensor and the item count; fp32 gradients, 4 bytes each.
A one-pass optimizer all-reduces once per step, a two-pass (sharpness-aware) one twice.

    python tools/comm_volume.py             # the table of docs/distributed.md
"""

from __future__ import annotations

import argparse
import os.path as osp
import sys
import tempfile

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401

VIT_B16 = {
    "embed_dim": 512,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12},
}
CONFIGS = {
    "CoOp": "configs/trainers/CoOp/vit_b16_ep50.yaml",
    "CoCoOp": "configs/trainers/CoCoOp/vit_b16_c4_ep10_batch1_ctxv1.yaml",
    "KgCoOp": "configs/trainers/KgCoOp/vit_b16_ep100_ctxv1.yaml",
    "TCP": "configs/trainers/TCP/vit_b16_ep100_ctxv1.yaml",
    "MaPLe": "configs/trainers/MaPLe/vit_b16_c2_ep5_batch4_2ctx.yaml",
    "IVLP": "configs/trainers/IVLP/vit_b16_c2_ep20_batch4_4+4ctx.yaml",
    "PromptSRC": "configs/trainers/PromptSRC/vit_b16_c2_ep20_batch4_4+4ctx.yaml",
    "CoPrompt": "configs/trainers/CoPrompt/vit_b16_c2_ep8_batch4_2ctx.yaml",
}


def volume(trainer: str, config: str, clip_opts: list[str], n_cls: int) -> dict:
    """Learnable numbers and tensors of ``trainer`` and the bytes per pass."""
    from engine import build_trainer
    from engine.cli import build_parser, setup_cfg

    root = osp.dirname(osp.dirname(osp.abspath(__file__)))
    args = ["--trainer", trainer, "--config-file", osp.join(root, config), *clip_opts]
    cfg = setup_cfg(build_parser().parse_args(args))
    tr = build_trainer(cfg, classnames=[f"class {i}" for i in range(n_cls)])
    params = [p for m in tr._models.values() for p in m.parameters() if p.requires_grad]
    numbers = sum(p.numel() for p in params)
    per_pass = 4 * (numbers + len(params) + 1)
    return {"numbers": numbers, "tensors": len(params), "bytes_per_pass": per_pass}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", nargs="+", default=list(CONFIGS))
    parser.add_argument("--classes", type=int, default=100, help="classes of the model")
    args = parser.parse_args(argv)
    import datasets  # noqa: F401  (registers the readers)
    import trainers  # noqa: F401  (registers the trainers)
    from engine.clip.toy import write_tiny_clip

    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, ckpt = write_tiny_clip(tmp, config=VIT_B16)
        clip_opts = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path]
        clip_opts += ["MODEL.BACKBONE.PATH", ckpt]
        print("| trainer (config) | learnable numbers | tensors | per pass | SAMPLe step |")
        print("|---|---|---|---|---|")
        for name in args.trainers:
            v = volume(name, CONFIGS[name], clip_opts, args.classes)
            kib = v["bytes_per_pass"] / 1024
            print(
                f"| {name} (`{osp.basename(CONFIGS[name])}`) | {v['numbers']:,} | "
                f"{v['tensors']} | {kib:,.1f} KiB | {2 * kib:,.1f} KiB |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
