from lightning_straggler.callbacks.injector import StragglerInjector
from lightning_straggler.callbacks.profiler import WorkerProfiler

__all__ = ["StragglerInjector", "WorkerProfiler"]
