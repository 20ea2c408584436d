"""The specee pack: read, write, validate, convert, bind to a target model."""

from specee_edge.pack.format import OFF, DraftHead, LayerExit, Pack, PackLevelError, QualityLevel, Schedule, TargetIdentity
from specee_edge.pack.io import PackError, read_pack, write_pack
from specee_edge.pack.target import PackMismatchError, check_target, target_identity

__all__ = [
    "OFF", "DraftHead", "LayerExit", "Pack", "PackError", "PackLevelError", "PackMismatchError", "QualityLevel", "Schedule", "TargetIdentity",
    "check_target", "read_pack", "target_identity", "write_pack",
]
