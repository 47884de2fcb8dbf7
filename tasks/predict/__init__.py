"""Merge or compose? The predict-sweep: unlabelled diagnostics against outcomes across many settings."""

from tasks.predict.config import PredictConfig
from tasks.predict.run import run_predict_sweep

__all__ = ["PredictConfig", "run_predict_sweep"]
