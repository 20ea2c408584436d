"""Calibration: make a pack (draft head, predictors, schedule) for a model on the user's machine."""

from specee_edge.calibrate.pipeline import CalibrateConfig, calibrate

__all__ = ["CalibrateConfig", "calibrate"]
