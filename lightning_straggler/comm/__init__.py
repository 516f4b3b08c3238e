"""Collectives: the only layer that talks to the communication engine.

Algorithms speak to :class:`Collectives`; :class:`HorovodCollectives` implements it with Horovod
process sets, so a second engine can be added without touching the strategies. :mod:`.fake` holds an
in-process world of ranks (one thread each) with Horovod's matching and join rules, for tests.
"""
from lightning_straggler.comm.base import Collectives, Group
from lightning_straggler.comm.horovod import HorovodCollectives

__all__ = ["Collectives", "Group", "HorovodCollectives"]
