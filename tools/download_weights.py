"""Fetch CLIP weights ahead of time, e.g. for compute nodes without internet access.

Usage::

    python tools/download_weights.py ViT-B/16 RN50            # OpenAI's names -> ~/.cache/clip
    python tools/download_weights.py ViT-B-16.pt               # or their file names
    python tools/download_weights.py ViT-B-16:laion2b_s34b_b88k   # open_clip tags (HF cache)
    python tools/download_weights.py hf-hub:org/name           # an open_clip Hugging Face repo
    python tools/download_weights.py --url URL --sha256 SHA    # any other address
    python tools/download_weights.py --list                    # OpenAI's names, addresses, cache
    python tools/download_weights.py --check [NAME ...]        # check cached files, no download

Each file lands where a run looks for it (``MODEL.BACKBONE.NAME NAME``, or
``MODEL.BACKBONE.URL URL MODEL.BACKBONE.SHA256 SHA``), through the same checked, atomic and
locked download as a run (``engine/clip/weights.py``; docs/weights.md). Exits with status 1 when a
file cannot be fetched (``--check``: is missing or damaged).
"""

from __future__ import annotations

import argparse
import logging
import os.path as osp
import sys

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401

from engine.clip import weights  # noqa: E402
from engine.clip.model import OPENAI_MODELS, ensure_weights, find_weights  # noqa: E402
from engine.config import get_cfg_default  # noqa: E402
from optim.errors import UserError  # noqa: E402


def backbone_cfg(name: str = "", url: str = "", sha256: str = ""):
    """A default config whose ``MODEL.BACKBONE`` names these weights."""
    cfg = get_cfg_default()
    cfg.MODEL.BACKBONE.NAME = name
    cfg.MODEL.BACKBONE.URL = url
    cfg.MODEL.BACKBONE.SHA256 = sha256
    return cfg


def openai_state(name: str, check: bool) -> str:
    """``present``/``missing`` of one of OpenAI's files (``ok``/``WRONG SHA256`` with ``check``)."""
    file_name = OPENAI_MODELS[name][1]
    path = osp.join(weights.clip_cache_dir(), file_name)
    if not osp.isfile(path):
        return "missing"
    if not check:
        return "present"
    return "ok" if weights.file_sha256(path) == weights.OPENAI_SHA256[file_name] else "WRONG SHA256"


def list_openai(check: bool) -> int:
    print(f"OpenAI's CLIP checkpoints (cache: {weights.clip_cache_dir()}):")
    for name, (_, file_name) in OPENAI_MODELS.items():
        print(f"  {name:<15} {openai_state(name, check):<13} {weights.openai_url(file_name)}")
    print("open_clip tags: arch:tag (open_clip.list_pretrained()) or hf-hub:org/name")
    return 0


def check(names: list[str], url: str, sha256: str) -> int:
    """Report the cached copies of ``names`` (all of OpenAI's files present when none given)."""
    if url:
        names = [url]
    elif not names:
        names = [n for n in OPENAI_MODELS if openai_state(n, False) != "missing"]
        if not names:
            print(f"No OpenAI checkpoint in {weights.clip_cache_dir()}")
            return 0
    bad = 0
    for name in map(openai_name, names):
        if name in OPENAI_MODELS:
            state = openai_state(name, True)
            path = osp.join(weights.clip_cache_dir(), OPENAI_MODELS[name][1])
        else:
            cfg = backbone_cfg(name="" if url else name, url=url, sha256=sha256)
            found, searched = find_weights(cfg)
            path = found or "; ".join(searched)
            state = "missing" if not found else "present"
            if found and url:
                ok = weights.file_sha256(found) == weights.check_sha256(sha256)
                state = "ok" if ok else "WRONG SHA256"
        bad += state in ("missing", "WRONG SHA256")
        print(f"{name}: {state} ({path})")
    return 1 if bad else 0


def openai_name(name: str) -> str:
    """OpenAI's name for one of its file names (``ViT-B-16.pt`` -> ``ViT-B/16``), else ``name``."""
    by_file = {file_name: n for n, (_, file_name) in OPENAI_MODELS.items()}
    return by_file.get(name, name)


def fetch(names: list[str], url: str, sha256: str) -> int:
    """Fetch each name (or the URL); returns the exit status."""
    names = [openai_name(n) for n in names]
    failed = 0
    items = [backbone_cfg(url=url, sha256=sha256)] if url else []
    items += [backbone_cfg(name=name) for name in names]
    for cfg in items:
        label = cfg.MODEL.BACKBONE.URL or cfg.MODEL.BACKBONE.NAME
        try:
            path = ensure_weights(cfg)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"{label}: {path}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    parser.add_argument("names", nargs="*", help="OpenAI names, arch:tag or hf-hub:org/name")
    parser.add_argument("--url", default="", help="another address (with --sha256)")
    parser.add_argument("--sha256", default="", help="the SHA256 of the file at --url")
    parser.add_argument("--list", action="store_true", help="list OpenAI's names and the cache")
    parser.add_argument("--check", action="store_true", help="check the cached files (no download)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.sha256 and not args.url:
        print("error: --sha256 goes with --url", file=sys.stderr)
        return 2
    try:
        if args.list:
            return list_openai(args.check)
        if args.check:
            return check(args.names, args.url, args.sha256)
        if not args.names and not args.url:
            build_parser().print_usage(sys.stderr)
            print("error: give one or more names, --url, --list or --check", file=sys.stderr)
            return 2
        return fetch(args.names, args.url, args.sha256)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
