"""Lightning strategies, one algorithm per module, registered by name on import."""
from lightning.pytorch.strategies import StrategyRegistry

from lightning_straggler.strategies.awar import AwarStrategy
from lightning_straggler.strategies.boa import BoaStrategy
from lightning_straggler.strategies.dpar import DparStrategy
from lightning_straggler.strategies.dssync import DSSyncStrategy
from lightning_straggler.strategies.horovod_base import HorovodStrategy
from lightning_straggler.strategies.ring import RingStrategy

# name -> (class, description); later algorithms add their row.
STRATEGIES = {
    RingStrategy.strategy_name: (RingStrategy, "Synchronous gradient all-reduce over all Horovod workers (baseline)"),
    AwarStrategy.strategy_name: (AwarStrategy, "Adaptive Weighted All-Reduce: stragglers train alone, weighted model average merges"),
    BoaStrategy.strategy_name: (BoaStrategy, "Batch orchestration: per-worker batch sizes so mixed-speed workers finish together"),
    DparStrategy.strategy_name: (DparStrategy, "Dynamic Partial All-Reduce: slow workers leave the all-reduce until they recover"),
    DSSyncStrategy.strategy_name: (DSSyncStrategy, "Divide-and-Shuffle: small groups average, membership reshuffled each step"),
}


def register_strategies(registry=StrategyRegistry) -> None:
    for name, (cls, description) in STRATEGIES.items():
        if name not in registry:
            registry.register(name, cls, description=description)


register_strategies()  # importing any strategy makes every name usable in Trainer(strategy=...)


__all__ = ["AwarStrategy", "BoaStrategy", "DparStrategy", "DSSyncStrategy", "HorovodStrategy", "RingStrategy", "STRATEGIES", "register_strategies"]
