"""Plugins: a user's own trainer, dataset reader or optimizer, loaded without editing the project.

A plugin is a Python module that registers something when it is imported (``@TRAINER_REGISTRY
.register()``, ``@DATASET_REGISTRY.register()``, ``register_optimizer(...)``). It is named

- on the command line: ``python train.py --plugin my_reader.py --plugin mypkg.trainers ...``
  (repeatable);
- in a config file or as a trailing option: ``PLUGINS: [my_reader.py]`` /
  ``PLUGINS "['my_reader.py']"``;
- in the environment: ``SAMPLE_PL_PLUGINS=a.py:mypkg.b`` (``os.pathsep``-separated), which
  reaches every tool and every run a grid starts.

An entry ending in ``.py`` (or naming an existing file) is imported from that file under its
file name (its folder is appended to ``sys.path`` so that it can import its sibling modules);
anything else is imported as a module name (``importlib.import_module``). Each plugin is
imported once per process, so a packed grid worker running many runs does not register twice.

Plugins are loaded before the default config is built, so that a plugin trainer's
``add_config`` keys exist when the config files are merged.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import os.path as osp
import sys
import traceback
from collections.abc import Iterable

import yaml

from .errors import ConfigError

logger = logging.getLogger(__name__)

ENV_VAR = "SAMPLE_PL_PLUGINS"

_loaded: dict[str, str] = {}  # key (absolute file path or module name) -> module name


def _is_file_spec(spec: str) -> bool:
    return spec.endswith(".py") or osp.isfile(spec)


def absolute_spec(spec: str) -> str:
    """A plugin as another process gets it (one that may start in another folder, e.g. a grid
    run or a SLURM job): a file by its absolute path, a module name as it is."""
    return osp.abspath(spec) if _is_file_spec(spec) else spec


def _key(spec: str) -> str:
    return osp.realpath(spec) if _is_file_spec(spec) else spec


def _module_name_for(path: str) -> str:
    """The module name a plugin file is imported under: its file name, unless a different
    module of that name is already imported (then a prefixed name)."""
    stem = osp.splitext(osp.basename(path))[0]
    if not stem.isidentifier():
        stem = "".join(c if c.isalnum() or c == "_" else "_" for c in stem)
    existing = sys.modules.get(stem)
    if existing is None or osp.realpath(getattr(existing, "__file__", "") or "") == path:
        return stem
    return f"sample_pl_plugin_{stem}"


def _import_file(path: str) -> str:
    if not osp.isfile(path):
        raise ConfigError(
            f"Plugin file not found: {path}. Give the path of a .py file (relative to the "
            "current folder) or an importable module name (--plugin / PLUGINS / "
            f"${ENV_VAR})."
        )
    folder = osp.dirname(path)
    if folder not in sys.path:
        sys.path.append(folder)  # appended: a plugin never shadows the project's packages
    name = _module_name_for(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"Plugin file {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise _import_error(path, e) from e
    return name


def _import_error(spec: str, e: Exception) -> ConfigError:
    where = traceback.extract_tb(e.__traceback__)[-1]
    return ConfigError(
        f"Plugin {spec} failed to import: {type(e).__name__}: {e} "
        f"(at {where.filename}:{where.lineno}). Fix the plugin or remove it from --plugin / "
        f"PLUGINS / ${ENV_VAR}."
    )


def load_plugins(specs: Iterable[str]) -> list[str]:
    """Import each plugin of ``specs`` once (see the module docstring; repeats are skipped);
    return the module names, in order. A missing file, an unknown module or an import that
    fails raises :class:`ConfigError` naming the plugin."""
    names = []
    for spec in specs:
        spec = str(spec).strip()
        if not spec:
            continue
        key = _key(spec)
        if key not in _loaded:
            if _is_file_spec(spec):
                _loaded[key] = _import_file(key)
            else:
                try:
                    importlib.import_module(spec)
                except ModuleNotFoundError as e:
                    missing = e.name or ""
                    if spec == missing or spec.startswith(missing + "."):
                        raise ConfigError(
                            f"Plugin module {spec!r} not found: give an importable module name "
                            "(on PYTHONPATH) or the path of a .py file"
                        ) from e
                    raise _import_error(spec, e) from e
                except Exception as e:
                    raise _import_error(spec, e) from e
                _loaded[key] = spec
            logger.info("Plugin loaded: %s (module %s)", spec, _loaded[key])
        names.append(_loaded[key])
    return names


def env_plugins() -> list[str]:
    """The plugins named in ``$SAMPLE_PL_PLUGINS``."""
    return [s for s in os.environ.get(ENV_VAR, "").split(os.pathsep) if s.strip()]


def plugins_in_files(paths: Iterable[str]) -> list[str]:
    """The ``PLUGINS`` entries of YAML config files (read before the config exists, since the
    plugins they name may add config keys). Unreadable files are left to the strict merge,
    which reports them."""
    found: list[str] = []
    for path in paths:
        if not path or not osp.isfile(path):
            continue
        try:
            with open(path) as f:
                values = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(values, dict):
            found.extend(_as_list(values.get("PLUGINS"), f"config file {path}"))
    return found


def plugins_in_opts(opts: list[str]) -> list[str]:
    """The ``PLUGINS`` values among trailing ``KEY VALUE`` options."""
    import ast

    found: list[str] = []
    for key, value in zip(opts[0::2], opts[1::2]):
        if key == "PLUGINS":
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                parsed = value
            found.extend(_as_list(parsed, "the command line"))
    return found


def _as_list(value, source: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(
        f"PLUGINS in {source} must be a list of module names or .py paths, got {value!r}"
    )
