"""lightning-straggler: Lightning strategies over Horovod that keep data-parallel training fast
when some workers are slow.

``import lightning_straggler`` registers every strategy name with Lightning (``Trainer(strategy="dpar")``)
without importing torch or Lightning itself: the names are registered as soon as ``lightning.pytorch``
is (or already was) imported. So ``lightning_straggler.policies`` and ``lightning_straggler.sim`` stay
usable without torch; the strategy classes (``lightning_straggler.RingStrategy`` ...) load on first use.
"""
from __future__ import annotations

import importlib.abc
import logging
import sys
from typing import Any

__version__ = "0.1.0"
__all__ = ["AdaptiveStrategy", "AwarStrategy", "BoaStrategy", "DparStrategy", "DSSyncStrategy", "HorovodStrategy", "RingStrategy",
           "STRATEGIES", "register_strategies", "__version__"]

_LAZY = frozenset(__all__) - {"register_strategies", "__version__"}
_log = logging.getLogger(__name__)


def register_strategies(registry: Any = None) -> None:
    """Register every strategy name with Lightning's ``StrategyRegistry`` (or ``registry``); each class is
    imported when Lightning builds it (``lightning_straggler/registry.py``)."""
    from lightning_straggler import registry as names

    names.register_strategies(registry)


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # the strategies import torch, Lightning and Horovod: only when asked for
        from lightning_straggler import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``lightning.pytorch`` is about to be imported, it wraps that module's
    loader so that the strategy names are registered right after the module has run (a Trainer cannot
    be built before that)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run = spec.loader.exec_module

                def exec_module(module: Any) -> None:
                    run(module)
                    _register_quietly()

                spec.loader.exec_module = exec_module
                return spec
        return None


def _register_quietly() -> None:
    # called from inside Lightning's import, which a failure here must not break (it needs only
    # Lightning's registry, so none is expected)
    try:
        register_strategies()
    except Exception as e:  # noqa: BLE001
        _log.warning("lightning_straggler: strategies not registered with Lightning (%s: %s)", type(e).__name__, e)


if "lightning.pytorch" in sys.modules:
    register_strategies()
elif not any(isinstance(f, _RegisterWhenLightningLoads) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())
