"""Built-in plugins. `BUILTINS` is the one list the registry starts from."""

from extproc.scheduling.plugins.pickers import MaxScorePicker, RandomPicker
from extproc.scheduling.plugins.scorers import ActiveRequestScorer

BUILTINS = (ActiveRequestScorer, MaxScorePicker, RandomPicker)

__all__ = ["BUILTINS", "ActiveRequestScorer", "MaxScorePicker", "RandomPicker"]
