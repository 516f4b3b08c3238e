"""Collectives: the only layer that talks to the communication engine.

Algorithms speak to :class:`Collectives`; :class:`HorovodCollectives` implements it with Horovod
process sets, so a second engine can be added without touching the strategies.
"""
from lightning_straggler.comm.base import Collectives, Group
from lightning_straggler.comm.horovod import HorovodCollectives

__all__ = ["Collectives", "Group", "HorovodCollectives"]
