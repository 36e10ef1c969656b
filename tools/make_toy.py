"""Write a tiny random CLIP and a generated DTD-layout dataset for a quick run without data.

    python tools/make_toy.py output/toy
    python train.py --root output/toy/data --trainer CoOp ... \
        MODEL.BACKBONE.NAME "" MODEL.BACKBONE.CONFIG output/toy/tiny_clip.json \
        MODEL.BACKBONE.PATH output/toy/tiny_clip.pt INPUT.SIZE "(32, 32)"
"""

from __future__ import annotations

import argparse
import os.path as osp

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401

from datasets.synthetic import make_dtd  # noqa: E402
from engine.clip.toy import write_tiny_clip  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output folder")
    parser.add_argument("--per-class", type=int, default=20, help="images per class")
    args = parser.parse_args(argv)
    cfg_path, ckpt = write_tiny_clip(args.out)
    make_dtd(osp.join(args.out, "data"), per_class=args.per_class)
    print(f"config: {cfg_path}\nweights: {ckpt}\ndata root: {osp.join(args.out, 'data')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
