"""A dataset's expected layout, found by reader, config, module or folder name (used by
``tools/check_data.py`` and ``tools/download_data.py``)."""

from __future__ import annotations

from datasets.common import Layout
from datasets.folder import PREFIX as FOLDER_PREFIX
from datasets.folder import folder_layout
from engine.registry import DATASET_REGISTRY


def find_layout(name: str) -> Layout | None:
    """The layout of a dataset given by reader name (``Caltech101``), config / module name
    (``caltech101``) or folder name (``caltech-101``), case-insensitively; None for a registered
    reader that declares no layout.

    ``folder:<folder>`` is the folder dataset ``<folder>`` (``DATASET.NAME Folder``).

    Raises:
        KeyError: no reader matches; the message lists the known names.
    """
    if name.startswith(FOLDER_PREFIX) and name[len(FOLDER_PREFIX) :].strip("/"):
        return folder_layout(name[len(FOLDER_PREFIX) :])
    if name.lower() == "folder":
        raise KeyError(
            "Folder reads the folder DATASET.FOLDER: check it as folder:<that folder>, e.g. "
            "folder:mydata"
        )
    known: dict[str, Layout | None] = {}
    for reg_name in DATASET_REGISTRY:
        cls = DATASET_REGISTRY.get(reg_name)
        layout = getattr(cls, "layout", None)
        layout = layout if isinstance(layout, Layout) else None
        keys = [reg_name, cls.__module__.rsplit(".", 1)[-1]] + ([layout.folder] if layout else [])
        for key in keys:
            known.setdefault(key.lower(), layout)
    if name.lower() not in known:
        raise KeyError(
            f"Unknown dataset '{name}'; known: {', '.join(DATASET_REGISTRY)} (or their config "
            "file or folder names)"
        )
    return known[name.lower()]
