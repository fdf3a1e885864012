"""Recursive least squares with exponential forgetting: a linear fit updated one sample at a
time in O(n^2), so old behaviour fades (a server slowed by another tenant is re-learned) and
nothing is ever refit from a stored history."""

from __future__ import annotations

from collections.abc import Sequence


class RecursiveLeastSquares:
    """Fits `y ~ w . x` for `n` features.

    `forgetting` in (0, 1]: each update multiplies the weight of everything seen before by it
    (0.9 remembers about the last 10 samples). `prior` is the initial covariance scale: large
    means the first samples decide. Not thread-safe; the learner loop owns it.
    """

    __slots__ = ("_cap", "_lam", "_p", "samples", "w")

    def __init__(self, n: int, *, forgetting: float = 0.95, prior: float = 1e3) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0, 1]")
        self._lam = forgetting
        self._cap = prior * n
        self.w = [0.0] * n
        self._p = [[prior if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.samples = 0

    def update(self, x: Sequence[float], y: float) -> None:
        n = len(self.w)
        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = self._lam + sum(x[i] * px[i] for i in range(n))
        if denom <= 1e-12:
            return
        gain = [v / denom for v in px]
        err = y - sum(self.w[i] * x[i] for i in range(n))
        self.w = [self.w[i] + gain[i] * err for i in range(n)]
        lam = self._lam
        # P <- (P - g (P x)^T) / lambda; P stays symmetric.
        p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        # Forgetting inflates P along directions the samples never vary in (windup); cap its
        # trace at the prior's so one odd sample cannot swing the fit.
        trace = sum(p[i][i] for i in range(n))
        if trace > self._cap:
            scale = self._cap / trace
            p = [[v * scale for v in row] for row in p]
        self._p = p
        self.samples += 1

    def reopen(self) -> None:
        """Forget how sure the fit is (not what it says): the next samples move it as much as
        the first ones did. For a law that just changed, faster than forgetting alone."""
        n = len(self.w)
        prior = self._cap / n
        self._p = [[prior if i == j else 0.0 for j in range(n)] for i in range(n)]

    def predict(self, x: Sequence[float]) -> float:
        return sum(w * v for w, v in zip(self.w, x, strict=True))
