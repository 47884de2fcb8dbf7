"""Ray as the executor of a run's cells (`--executor ray`): `RayExecutor`."""

from mergecompose.integrations.ray.executor import RayExecutor, RayUnavailable

__all__ = ["RayExecutor", "RayUnavailable"]
