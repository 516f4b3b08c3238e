"""The strategy names Lightning resolves (``Trainer(strategy="dpar")``), without importing the strategies.

Each name is registered with a small factory that imports its class when Lightning builds the strategy,
so registering needs nothing but Lightning's registry (no torch import of ours, no import cycle when
Lightning itself is being loaded by one of this package's modules).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Tuple

# name -> (module, class, description); a new algorithm adds its row
STRATEGY_TABLE: Dict[str, Tuple[str, str, str]] = {
    "ring": ("lightning_straggler.strategies.ring", "RingStrategy",
             "Synchronous gradient all-reduce over all Horovod workers (baseline)"),
    "awar": ("lightning_straggler.strategies.awar", "AwarStrategy",
             "Adaptive Weighted All-Reduce: stragglers train alone, weighted model average merges"),
    "boa": ("lightning_straggler.strategies.boa", "BoaStrategy",
            "Batch orchestration: per-worker batch sizes so mixed-speed workers finish together"),
    "dpar": ("lightning_straggler.strategies.dpar", "DparStrategy",
             "Dynamic Partial All-Reduce: slow workers leave the all-reduce until they recover"),
    "dssync": ("lightning_straggler.strategies.dssync", "DSSyncStrategy",
               "Divide-and-Shuffle: small groups average, membership reshuffled each step"),
    "adaptive": ("lightning_straggler.strategies.adaptive", "AdaptiveStrategy",
                 "BOA's per-worker batch sizes, re-planned within a few steps of any worker's speed change"),
}


def strategy_class(name: str) -> type:
    module, cls, _ = STRATEGY_TABLE[name]
    return getattr(importlib.import_module(module), cls)


def _factory(name: str) -> Callable[..., Any]:
    def build(**init_params: Any) -> Any:
        return strategy_class(name)(**init_params)

    build.__name__ = build.__qualname__ = STRATEGY_TABLE[name][1]
    return build


def register_strategies(registry: Any = None) -> None:
    """Register every name with Lightning's ``StrategyRegistry`` (or ``registry``); names already there stay."""
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry as registry
    for name, (_, _, description) in STRATEGY_TABLE.items():
        if name not in registry:
            registry.register(name, _factory(name), description=description)
