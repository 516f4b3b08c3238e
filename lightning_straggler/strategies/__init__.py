"""Lightning strategies, one algorithm per module, registered by name on import."""
from lightning_straggler.strategies.adaptive import AdaptiveStrategy
from lightning_straggler.strategies.awar import AwarStrategy
from lightning_straggler.strategies.boa import BoaStrategy
from lightning_straggler.strategies.dpar import DparStrategy
from lightning_straggler.strategies.dssync import DSSyncStrategy
from lightning_straggler.strategies.horovod_base import HorovodStrategy
from lightning_straggler.strategies.ring import RingStrategy

from lightning_straggler.registry import STRATEGY_TABLE, register_strategies

# name -> (class, description), from the one table of names (lightning_straggler/registry.py)
STRATEGIES = {name: (globals()[cls], description) for name, (_, cls, description) in STRATEGY_TABLE.items()}

register_strategies()  # importing any strategy makes every name usable in Trainer(strategy=...)

__all__ = ["AdaptiveStrategy", "AwarStrategy", "BoaStrategy", "DparStrategy", "DSSyncStrategy", "HorovodStrategy", "RingStrategy", "STRATEGIES", "register_strategies"]
