"""Merge or compose? The predict-sweep: unlabelled diagnostics against outcomes across many settings."""

from mergecompose.studies.predict.predict_config import PredictConfig, preflight_predict
from mergecompose.studies.predict.predict_sweep import run_predict_sweep

__all__ = ["PredictConfig", "preflight_predict", "run_predict_sweep"]
