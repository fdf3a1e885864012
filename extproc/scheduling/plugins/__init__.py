"""Built-in plugins. `BUILTINS` is the one list the registry starts from."""

from extproc.scheduling.handlers import DisaggProfileHandler, SingleProfileHandler
from extproc.scheduling.plugins.affinity import EncoderCacheScorer, SessionAffinityScorer
from extproc.scheduling.plugins.filters import (
    DecodeFilter,
    EncodeFilter,
    LabelSelectorFilter,
    PrefillFilter,
)
from extproc.scheduling.plugins.latency import BoundedLoadFilter, PredictedTTFTScorer
from extproc.scheduling.plugins.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from extproc.scheduling.plugins.prefix import (
    NoHitLRUScorer,
    PrefixCacheAffinityFilter,
    PrefixCacheScorer,
)
from extproc.scheduling.plugins.scorers import (
    ActiveRequestScorer,
    KVCacheUtilizationScorer,
    LoadAwareScorer,
    LoraAffinityScorer,
    QueueScorer,
    TokenLoadScorer,
)

BUILTINS: tuple[type, ...] = (
    SingleProfileHandler,
    DisaggProfileHandler,
    PrefixCacheScorer,
    PrefixCacheAffinityFilter,
    NoHitLRUScorer,
    PredictedTTFTScorer,
    BoundedLoadFilter,
    QueueScorer,
    KVCacheUtilizationScorer,
    ActiveRequestScorer,
    TokenLoadScorer,
    LoadAwareScorer,
    LoraAffinityScorer,
    SessionAffinityScorer,
    EncoderCacheScorer,
    DecodeFilter,
    PrefillFilter,
    EncodeFilter,
    LabelSelectorFilter,
    MaxScorePicker,
    RandomPicker,
    WeightedRandomPicker,
)

__all__ = ["BUILTINS"]
