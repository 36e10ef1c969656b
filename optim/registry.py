"""The generic name -> object registry (trainers, datasets, evaluators, optimizers use it).

It lives at the bottom of the import graph (``optim`` imports nothing from ``engine``);
``engine.registry`` re-exports it with the engine's registries.

A registry maps a string name to a class or factory. Registering the same name twice raises;
looking up an unknown name raises with the registered names and the closest match, Dassl-style
("(do you mean [x]?)"), so a typo in a config file is a one-line fix.

Example::

    TRAINER_REGISTRY = Registry("trainer")

    @TRAINER_REGISTRY.register()
    class CoOp(TrainerX):
        ...

    cls = TRAINER_REGISTRY.get("CoOp")
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Any

from .errors import UserError


class RegistryError(UserError, KeyError):
    """An unknown or duplicate registry name. Its message is the whole explanation."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class Registry:
    """A named mapping from strings to objects, filled by a decorator.

    Args:
        name: what is registered, used in error messages ("trainer", "dataset", ...).
    """

    def __init__(self, name: str):
        self._name = name
        self._obj_map: dict[str, Any] = {}

    def _do_register(self, name: str, obj: Any, force: bool = False) -> None:
        if name in self._obj_map and not force:
            raise RegistryError(
                f"A {self._name} named '{name}' is already registered "
                f"({self._obj_map[name]!r}); choose another name or pass force=True"
            )
        self._obj_map[name] = obj

    def register(self, obj: Any = None, force: bool = False, name: str | None = None):
        """Register ``obj`` under ``name`` (default: ``obj.__name__``).

        Used as ``@REG.register()`` or ``REG.register(obj)``.
        """
        if obj is None:

            def deco(func_or_class: Callable) -> Callable:
                self._do_register(name or func_or_class.__name__, func_or_class, force=force)
                return func_or_class

            return deco
        self._do_register(name or obj.__name__, obj, force=force)
        return obj

    def get(self, name: str) -> Any:
        """Return the object registered as ``name``; unknown names raise with a suggestion."""
        if name not in self._obj_map:
            raise RegistryError(self.unknown_message(name))
        return self._obj_map[name]

    def unknown_message(self, name: str) -> str:
        names = self.registered_names()
        msg = f"Unknown {self._name} '{name}'"
        lower = {n.lower(): n for n in names}
        if name.lower() in lower:  # a case slip: 'coop' -> 'CoOp'
            close = [lower[name.lower()]]
        else:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.4)
        if close:
            msg += f" (do you mean [{close[0]}]?)"
        if names:
            msg += f". Available {self._name}s: {', '.join(sorted(names))}"
        else:
            msg += (
                f". No {self._name} is registered yet: import the package that registers them "
                "first (train.py imports trainers and datasets)"
            )
        return msg

    def name_of(self, obj: Any) -> str | None:
        """The first name ``obj`` is registered under (None if it is not registered)."""
        for name, registered in self._obj_map.items():
            if registered is obj:
                return name
        return None

    def registered_names(self) -> list[str]:
        return list(self._obj_map.keys())

    def __contains__(self, name: object) -> bool:
        return name in self._obj_map

    def __iter__(self) -> Iterator[str]:
        return iter(self._obj_map)

    def __len__(self) -> int:
        return len(self._obj_map)

    def __repr__(self) -> str:
        return f"Registry({self._name!r}, {sorted(self._obj_map)})"
