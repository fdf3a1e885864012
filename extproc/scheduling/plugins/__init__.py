"""Built-in plugins. `BUILTINS` is the one list the registry starts from."""

from extproc.scheduling.handlers import DisaggProfileHandler, SingleProfileHandler
from extproc.scheduling.plugins.affinity import (
    EncoderCacheScorer,
    HeaderLabelAffinityScorer,
    SessionAffinityFilter,
    SessionAffinityScorer,
)
from extproc.scheduling.plugins.attributes import EndpointAttributeFilter, EndpointAttributeScorer
from extproc.scheduling.plugins.context_length import ContextLengthAware
from extproc.scheduling.plugins.deciders import (
    AlwaysDisaggMultimodalDecider,
    AlwaysDisaggPDDecider,
    PrefixBasedPDDecider,
)
from extproc.scheduling.plugins.filters import (
    ByLabelFilter,
    ByLabelSelectorFilter,
    DecodeFilter,
    EncodeFilter,
    LabelSelectorFilter,
    PrefillFilter,
)
from extproc.scheduling.plugins.gie_legacy import (
    DecisionTreeFilter,
    KVCacheScorer,
    LeastKVCacheFilter,
    LeastQueueFilter,
    LoraAffinityFilter,
    LowQueueFilter,
)
from extproc.scheduling.plugins.latency import (
    LatencyScorer,
    LatencySloAdmitter,
    PredictedLatencyProducer,
    SloHeadroomTierFilter,
)
from extproc.scheduling.plugins.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from extproc.scheduling.plugins.prefix import (
    NoHitLRUScorer,
    PrefixCacheAffinityFilter,
    PrefixCacheScorer,
)
from extproc.scheduling.plugins.profile_handlers import (
    DataParallelProfileHandler,
    HeaderProfileHandler,
    PdProfileHandler,
)
from extproc.scheduling.plugins.scorers import (
    ActiveRequestScorer,
    KVCacheUtilizationScorer,
    LoadAwareScorer,
    LoraAffinityScorer,
    QueueScorer,
    TokenLoadScorer,
)
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter, SessionTailScorer
from extproc.scheduling.plugins.topology import TopologyAffinityFilter, TopologyAffinityScorer
from extproc.scheduling.plugins.ttft import BoundedLoadFilter, PredictedTTFTScorer
from extproc.scheduling.plugins.utilization import RunningRequestsSizeScorer, UtilizationFilter

BUILTINS: tuple[type, ...] = (
    SingleProfileHandler,
    DisaggProfileHandler,
    PrefixCacheScorer,
    PrefixCacheAffinityFilter,
    NoHitLRUScorer,
    PredictedTTFTScorer,
    BoundedLoadFilter,
    BoundedSessionsFilter,
    SessionTailScorer,
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
    # llm-d's further scheduling plugins
    DataParallelProfileHandler,
    PdProfileHandler,
    HeaderProfileHandler,
    PrefixBasedPDDecider,
    AlwaysDisaggPDDecider,
    AlwaysDisaggMultimodalDecider,
    SessionAffinityFilter,
    HeaderLabelAffinityScorer,
    ByLabelFilter,
    ByLabelSelectorFilter,
    ContextLengthAware,
    UtilizationFilter,
    RunningRequestsSizeScorer,
    TopologyAffinityFilter,
    TopologyAffinityScorer,
    EndpointAttributeFilter,
    EndpointAttributeScorer,
    # GIE v0.5's chart-default plugins
    LowQueueFilter,
    LeastQueueFilter,
    LeastKVCacheFilter,
    LoraAffinityFilter,
    DecisionTreeFilter,
    KVCacheScorer,
    # predicted latency
    PredictedLatencyProducer,
    LatencyScorer,
    SloHeadroomTierFilter,
    LatencySloAdmitter,
)

__all__ = ["BUILTINS"]
