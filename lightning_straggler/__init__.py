"""lightning-straggler: Lightning strategies over Horovod that keep data-parallel training fast
when some workers are slow. Importing the package registers every strategy name with Lightning."""
from lightning_straggler.strategies import (STRATEGIES, AwarStrategy, BoaStrategy, DparStrategy, DSSyncStrategy, HorovodStrategy, RingStrategy,
                                            register_strategies)

register_strategies()

__version__ = "0.1.0"
__all__ = ["AwarStrategy", "BoaStrategy", "DparStrategy", "DSSyncStrategy", "HorovodStrategy", "RingStrategy", "STRATEGIES", "register_strategies", "__version__"]
