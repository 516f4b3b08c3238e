"""Lightning strategies, one algorithm per module, registered by name on import."""
from lightning.pytorch.strategies import StrategyRegistry

from lightning_straggler.strategies.dssync import DSSyncStrategy
from lightning_straggler.strategies.horovod_base import HorovodStrategy
from lightning_straggler.strategies.ring import RingStrategy

# name -> (class, description); later algorithms add their row.
STRATEGIES = {
    RingStrategy.strategy_name: (RingStrategy, "Synchronous gradient all-reduce over all Horovod workers (baseline)"),
    DSSyncStrategy.strategy_name: (DSSyncStrategy, "Divide-and-Shuffle: small groups average, membership reshuffled each step"),
}


def register_strategies(registry=StrategyRegistry) -> None:
    for name, (cls, description) in STRATEGIES.items():
        if name not in registry:
            registry.register(name, cls, description=description)


__all__ = ["DSSyncStrategy", "HorovodStrategy", "RingStrategy", "STRATEGIES", "register_strategies"]
