"""The specee pack: read, write, validate, convert, bind to a target model."""

from specee_edge.pack.format import (EXACT_QUALITY, OFF, DraftHead, LayerExit, Pack, PackLevelError, QualityLevel, Schedule,
                                     TargetIdentity, parse_quality, quality_name)
from specee_edge.pack.io import PackError, read_pack, write_pack
from specee_edge.pack.target import PackMismatchError, check_target, target_identity

__all__ = [
    "EXACT_QUALITY", "OFF", "DraftHead", "LayerExit", "Pack", "PackError", "PackLevelError", "PackMismatchError", "QualityLevel", "Schedule", "TargetIdentity",
    "check_target", "parse_quality", "quality_name", "read_pack", "target_identity", "write_pack",
]
