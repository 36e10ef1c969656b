"""Generate the SmallWorld dataset folder (``ROOT/small_world``, see datasets/small_world.py).

The reader generates the folder with the default settings on first use; this tool does it
explicitly, with other settings if wanted. Generation is deterministic: the same seed and
settings give byte-identical files.

Examples::

    python tools/make_small_world.py --root DATA                 # the default world
    python tools/make_small_world.py --root DATA --test 20 --force
    python train.py --root DATA --dataset-config-file configs/datasets/small_world.yaml ...

An existing folder made with the same settings is kept (exit 0); one made with other settings
is an error unless ``--force`` regenerates it.
"""

from __future__ import annotations

import argparse
import json
import os.path as osp
import sys
import time

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401


from datasets.small_world import (  # noqa: E402
    CLASSNAMES,
    DATASET_FOLDER,
    DEFAULT_COUNTS,
    DEFAULT_SEED,
    HUE_SHIFT,
    META_FILE,
    WORLD_VERSION,
    generate_small_world,
)


def requested_meta(args) -> dict:
    """The world.json fields that the arguments determine."""
    return {
        "version": WORLD_VERSION,
        "seed": args.seed,
        "counts": {"train": args.train, "val": args.val, "test": args.test},
        "hue_shift": float(args.hue_shift),
    }


def existing_meta(folder: str) -> dict | None:
    path = osp.join(folder, META_FILE)
    if not osp.isfile(path):
        return None
    with open(path) as f:
        meta = json.load(f)
    return {k: meta.get(k) for k in ("version", "seed", "counts", "hue_shift")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--root", required=True, help="dataset root (DATASET.ROOT / --root)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="generation seed")
    for split, n in DEFAULT_COUNTS.items():
        parser.add_argument(f"--{split}", type=int, default=n, help=f"{split} images per class")
    parser.add_argument(
        "--hue-shift", type=float, default=HUE_SHIFT, help="hue rotation (degrees) of the images"
    )
    parser.add_argument("--force", action="store_true", help="regenerate an existing folder")
    args = parser.parse_args(argv)

    folder = osp.join(osp.abspath(osp.expanduser(args.root)), DATASET_FOLDER)
    want = requested_meta(args)
    have = existing_meta(folder)
    if osp.exists(folder) and not args.force:
        if have == want:
            print(f"SmallWorld already in {folder} (same settings): kept")
            return 0
        print(
            f"Error: {folder} exists with other settings ({have or 'no ' + META_FILE}); pass "
            "--force to regenerate it or choose another --root",
            file=sys.stderr,
        )
        return 2
    t0 = time.time()
    try:
        generate_small_world(
            args.root,
            seed=args.seed,
            counts=want["counts"],
            hue_shift=args.hue_shift,
            overwrite=args.force,
        )
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    n = sum(want["counts"].values()) * len(CLASSNAMES)
    took = time.time() - t0
    print(f"Generated SmallWorld ({n} images, seed {args.seed}) in {folder} ({took:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
