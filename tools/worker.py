"""The worker process of ``experiments/worker.py``'s :class:`Worker`: runs train.py runs in-process
(``python -m tools.worker --reply-fd N``; the protocol is in :func:`engine.runner.serve`)."""

from __future__ import annotations

import argparse
import sys

if __package__ in (None, ""):  # run as a script
    import _repo  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A worker that runs train.py runs in-process.")
    parser.add_argument("--reply-fd", type=int, required=True, help="where answers go")
    args = parser.parse_args(argv)
    import datasets  # noqa: F401  (registers the dataset readers, as train.py does)
    import trainers  # noqa: F401  (registers the trainers, as train.py does)
    from engine.runner import finish_process, serve

    return finish_process(serve(args.reply_fd))


if __name__ == "__main__":
    sys.exit(main())
