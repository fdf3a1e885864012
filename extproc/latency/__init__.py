"""Predicted latency: a per-endpoint TTFT/TPOT model learned online from what the picker sees.

`model.LatencyModel` predicts on the hot path (a few float operations per candidate) and is
taught off it by `endpoints.latency_learner.LatencyLearner`, a background loop that
differences the vLLM latency histograms the metrics scraper collects (`server.latency` runs
it and exports its metrics). `rls.RecursiveLeastSquares` is the fit. A pure layer: no I/O.
"""

from extproc.latency.model import Coefficients, LatencyModel, ModelSettings, Prediction

__all__ = ["Coefficients", "LatencyModel", "ModelSettings", "Prediction"]
