"""A trainer file's failure as one paragraph, not a traceback.

A trainer file of another repository (loaded with ``--plugin``) that fails while its model is
built or in a training step raises :class:`TrainerFileError`, which ``train.py`` prints as one
paragraph (exit status 2): the file, the line of that repository where it failed (the
innermost frame in the file's repository, e.g. its bundled ``clip`` package), the missing name
(an attribute, a config key, a module), and the project's nearest supported route: the
project's own trainer of that name, the module form of a package's file, or an issue named after
the trainer. Errors that do not pass through the file's repository keep their traceback.
"""

from __future__ import annotations

import linecache
import os.path as osp
import sys
import traceback

from optim.errors import UserError

_PROJECT_ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


class TrainerFileError(UserError, RuntimeError):
    """A trainer file of another repository failed (see the module docstring)."""


def _repository(path: str) -> str:
    """The folder of a trainer file's code: its repository's root for ``<root>/trainers/x.py``
    (or any package), else the file's folder."""
    folder = osp.dirname(osp.realpath(path))
    while osp.isfile(osp.join(folder, "__init__.py")) and osp.dirname(folder) != folder:
        folder = osp.dirname(folder)
    return folder


def _inside(path: str, folder: str) -> bool:
    path = osp.realpath(path)
    return path == folder or path.startswith(folder + osp.sep)


def _missing_name(e: BaseException) -> str | None:
    if isinstance(e, (AttributeError, NameError, ImportError)) and getattr(e, "name", None):
        return e.name
    if isinstance(e, (AttributeError, KeyError)) and len(e.args) == 1:
        arg = e.args[0]
        if isinstance(arg, str) and (isinstance(e, KeyError) or arg.isidentifier()):
            return arg
    return None


def _route(cls, name: str, file: str) -> str:
    replaced = cls.__dict__.get("_replaces")
    if replaced is not None:
        return (
            f"This project has its own {name}, which reads this code base's config files and "
            f"scripts: run --trainer {name} without this --plugin (docs/neighbours.md)."
        )
    module = cls.__module__
    folder = osp.dirname(osp.realpath(file))
    if "." not in module and osp.isfile(osp.join(folder, "__init__.py")):
        package = osp.basename(folder)
        return (
            f"The file belongs to the package {package!r}: load it as a module, --plugin "
            f"{package}.{module} with {osp.dirname(folder)} on PYTHONPATH "
            "(docs/porting-trainers.md); if it still fails, open an issue named "
            f"'{name} trainer' with this message."
        )
    return (
        f"This project has no trainer {name} of its own: port the file "
        f"(docs/porting-trainers.md), or open an issue named '{name} trainer' with this message."
    )


def trainer_file_error(cls, e: BaseException, stage: str) -> TrainerFileError | None:
    """The paragraph for ``e``, raised by the trainer class ``cls`` (a Dassl file's) during
    ``stage``; None when ``e`` did not pass through the file's repository."""
    module = sys.modules.get(cls.__module__)
    file = getattr(module, "__file__", None)
    if not file or _inside(file, _PROJECT_ROOT):
        return None
    repo = _repository(file)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if _inside(f.filename, repo)]
    if not frames:
        return None
    where = frames[-1]
    line = (where.line or linecache.getline(where.filename, where.lineno)).strip()
    missing = _missing_name(e)
    what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    named = f"; the missing name is {missing!r}" if missing is not None else ""
    own = (
        ""
        if osp.realpath(where.filename) == osp.realpath(file)
        else (
            f" (in {osp.relpath(where.filename, repo)} of the file's repository {repo}, not in "
            "this project's compatibility packages)"
        )
    )
    name = cls.__name__
    if ".cuda(" in line:  # a file that moves its model to the GPU itself
        named += (
            "; the file moves its model to the GPU itself (.cuda()), so it needs a GPU, as in "
            "its own repository"
        )
    return TrainerFileError(
        f"The trainer file {file} ({name}) failed {stage}: {what} at "
        f"{where.filename}:{where.lineno}{own}: `{line}`{named}. {_route(cls, name, file)}"
    )
