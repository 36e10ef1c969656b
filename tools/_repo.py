"""The repository root on ``sys.path`` for tools run as ``python tools/<name>.py``.

Every tool starts with::

    if __package__ in (None, ""):  # run as a script
        import _repo  # noqa: F401

(``tools/`` is then ``sys.path[0]``, so this module is found); imported as ``tools.<name>``
(tests, other tools) the repository is importable already.
"""

import os.path as osp
import sys

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
