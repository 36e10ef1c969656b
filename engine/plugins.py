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

A module name whose package is also one of this project's (every CoOp-family repository keeps
its trainer files in a package named ``trainers``, as this project does) is the other
repository's: ``--plugin trainers.tcp`` with that repository's root on ``PYTHONPATH`` imports its
``trainers/tcp.py`` as a module of its own package (under another name, so that its relative
imports find its siblings), never this project's ``trainers/tcp.py``; without such a root it is
refused, naming the clash and the fix. A file with relative imports (``from .x import y``) named
by its path is refused with the module form that loads it.

A plugin may declare config keys (Dassl's ``extend_cfg``): a module-level ``extend_cfg(cfg)``
function, and for a trainer file in a repository laid out like the CoOp family's (the file in
``<root>/trainers/``), the ``extend_cfg`` of ``<root>/train.py`` (only that function is run, not
the script). The keys they add that the project does not have are added to the config
(:func:`add_plugin_config`; e.g. ProGrad's ``LOSS.*`` with ``prograd.py``); existing keys keep
the project's defaults and types.

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
from .yaml_files import read_yaml

logger = logging.getLogger(__name__)

ENV_VAR = "SAMPLE_PL_PLUGINS"

_loaded: dict[str, str] = {}  # key (absolute file path or module name) -> module name
# the extend_cfg functions the loaded plugins declare: (where, function)
_extensions: list[tuple[str, object]] = []
_PROJECT_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


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
        if _is_relative_import_error(e):
            raise _relative_import_error(path, e) from e
        raise _import_error(path, e) from e
    _declare_config(module, path)
    return name


def _is_relative_import_error(e: Exception) -> bool:
    return isinstance(e, ImportError) and "no known parent package" in str(e)


def _relative_import_error(path: str, e: Exception) -> ConfigError:
    """A file named by its path that imports its package's modules relatively."""
    where = traceback.extract_tb(e.__traceback__)[-1]
    folder = osp.dirname(path)
    package, parent = osp.basename(folder), osp.dirname(folder)
    module = f"{package}.{osp.splitext(osp.basename(path))[0]}"
    return ConfigError(
        f"Plugin file {path} imports its package's modules relatively ({where.line!r} at "
        f"{where.filename}:{where.lineno}), so it is a module of the package {package!r} "
        f"({folder}) and cannot be loaded by its path. Load it as a module: --plugin {module} "
        f"with {parent} on PYTHONPATH, e.g. PYTHONPATH={parent} python train.py --plugin "
        f"{module} ... (a package named like one of this project's is still the other "
        "repository's; docs/porting-trainers.md)."
    )


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
                    module = _import_module(spec)
                except ModuleNotFoundError as e:
                    missing = e.name or ""
                    if spec == missing or spec.startswith(missing + "."):
                        raise ConfigError(
                            f"Plugin module {spec!r} not found: give an importable module name "
                            "(on PYTHONPATH) or the path of a .py file"
                        ) from e
                    raise _import_error(spec, e) from e
                except ConfigError:
                    raise
                except Exception as e:
                    raise _import_error(spec, e) from e
                _loaded[key] = module.__name__
                _declare_config(module, getattr(module, "__file__", None) or spec)
            logger.info("Plugin loaded: %s (module %s)", spec, _loaded[key])
        names.append(_loaded[key])
    return names


def _in_project(path: str | None) -> bool:
    if not path:
        return False
    path = osp.realpath(path)
    return path == _PROJECT_ROOT or path.startswith(_PROJECT_ROOT + os.sep)


def _project_package(top: str) -> str | None:
    """The folder of this project's package ``top``, or None when ``top`` is not one."""
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    locations = list(getattr(found, "submodule_search_locations", None) or [])
    if found is None or not locations or not all(_in_project(p) for p in locations):
        return None
    return locations[0]


def _other_roots(top: str, rest: list[str]) -> list[str]:
    """The folders on ``sys.path`` outside this project that hold a package ``top`` with the
    module ``top.rest`` (a file or a package)."""
    roots = []
    for entry in sys.path:
        root = osp.realpath(entry or os.getcwd())
        if _in_project(root) or root in roots:
            continue
        base = osp.join(root, top, *rest)
        if osp.isfile(osp.join(root, top, "__init__.py")) and (
            osp.isfile(base + ".py") or osp.isfile(osp.join(base, "__init__.py")) or not rest
        ):
            roots.append(root)
    return roots


def _alias_package(top: str, root: str):
    """The package ``root/top`` imported under a name of its own (``<top>_of_<root name>``), so
    that it and this project's package ``top`` coexist and its relative imports resolve."""
    folder = osp.join(root, top)
    stem = "".join(c if c.isalnum() else "_" for c in osp.basename(root))
    alias = f"{top}_of_{stem}"
    n = 1
    while alias in sys.modules:
        existing = sys.modules[alias]
        if [osp.realpath(p) for p in getattr(existing, "__path__", [])] == [folder]:
            return alias
        n += 1
        alias = f"{top}_of_{stem}_{n}"
    spec = importlib.util.spec_from_file_location(
        alias, osp.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[alias]
        raise
    return alias


def _import_module(spec: str):
    """Import the module ``spec``; one whose package is also this project's is the other
    repository's (see the module docstring)."""
    top, *rest = spec.split(".")
    own = _project_package(top)
    if own is None:
        return importlib.import_module(spec)
    roots = _other_roots(top, rest)
    if not roots:
        mine = osp.join(own, *rest)
        mine = mine + ".py" if osp.isfile(mine + ".py") else mine
        raise ConfigError(
            f"Plugin module {spec!r} names this project's own package {top!r} ({mine}): no "
            f"folder on PYTHONPATH outside this project holds a {top}/{'/'.join(rest) or ''} "
            f"of another repository, and this project's own modules are no plugins (its "
            f"trainers are registered already: --trainer <name>). To load another "
            f"repository's {spec}, put that repository's root (the folder that holds its "
            f"{top}/) on PYTHONPATH: PYTHONPATH=/path/to/repo python train.py --plugin {spec} "
            "..."
        )
    if len(roots) > 1:
        logger.warning(
            "Plugin %s: several folders on PYTHONPATH hold %s/; the first is used: %s",
            spec,
            top,
            ", ".join(roots),
        )
    alias = _alias_package(top, roots[0])
    module = importlib.import_module(".".join([alias, *rest]))
    logger.info(
        "Plugin %s is %s of %s (imported as %s; this project's own package %s is %s)",
        spec,
        getattr(module, "__file__", spec),
        roots[0],
        module.__name__,
        top,
        own,
    )
    return module


def _repository_extend_cfg(path: str):
    """``extend_cfg`` of the ``train.py`` of the repository that holds the trainer file
    ``path`` (``<root>/trainers/<file>.py``), compiled alone (the script is not run), or None."""
    import ast

    folder = osp.dirname(osp.realpath(path))
    train = osp.join(osp.dirname(folder), "train.py")
    if osp.basename(folder) != "trainers" or _in_project(train) or not osp.isfile(train):
        return None, train
    try:
        with open(train) as f:
            tree = ast.parse(f.read(), train)
    except (OSError, SyntaxError, ValueError):
        return None, train
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "extend_cfg"]
    if not found:
        return None, train
    from yacs.config import CfgNode

    namespace = {"CN": CfgNode, "CfgNode": CfgNode}
    exec(compile(ast.Module(body=found, type_ignores=[]), train, "exec"), namespace)
    return namespace["extend_cfg"], train


def _declare_config(module, path: str) -> None:
    """Record the config keys ``module`` declares (module docstring)."""
    own = getattr(module, "extend_cfg", None)
    if callable(own):
        _extensions.append((f"extend_cfg of {path}", own))
    if path and osp.isfile(path):
        fn, train = _repository_extend_cfg(path)
        if fn is not None:
            _extensions.append((f"extend_cfg of {train}", fn))


def add_plugin_config(cfg) -> list[str]:
    """Add the keys that the loaded plugins declare (module docstring) and ``cfg`` lacks;
    return them. Keys ``cfg`` has keep their values and types."""
    import copy

    from yacs.config import CfgNode

    added: list[str] = []

    def merge(into, extra, prefix):
        for k, v in extra.items():
            if k not in into:
                into[k] = copy.deepcopy(v)
                added.append(prefix + k)
            elif isinstance(v, CfgNode) and isinstance(into[k], CfgNode):
                merge(into[k], v, f"{prefix}{k}.")

    for where, fn in _extensions:
        scratch = copy.deepcopy(cfg)
        try:
            fn(scratch)
        except Exception as e:
            raise ConfigError(
                f"The {where} (config keys a plugin declares) failed: {type(e).__name__}: {e}"
            ) from e
        merge(cfg, scratch, "")
    return added


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
            values = read_yaml(path) or {}
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
