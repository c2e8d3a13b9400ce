"""The fleet manager (`fairway fleet`): reads the replicas' heartbeats, forecasts arrivals, and
adds or drains replicas through a backend (local processes, or a Kubernetes Deployment)."""

from fairway.fleet.backend import Backend, BackendError, BackendState, BackendUnavailable
from fairway.fleet.forecast import HoltForecaster
from fairway.fleet.manager import FleetManager
from fairway.fleet.policy import (
           Decision,
           FleetConfigError,
           FleetView,
           ScalingBounds,
           ScalingPolicy,
           ScalingTarget,
)
from fairway.fleet.signals import ArrivalMeter, FleetSample, read_sample

__all__ = ["ArrivalMeter", "Backend", "BackendError", "BackendState", "BackendUnavailable", "Decision",
           "FleetConfigError", "FleetManager", "FleetSample", "FleetView", "HoltForecaster", "ScalingBounds",
           "ScalingPolicy", "ScalingTarget", "read_sample"]
