from spin.v1 import model_info_pb2 as _model_info_pb2
from spin.v1 import sampling_pb2 as _sampling_pb2
from spin.v1 import token_tree_pb2 as _token_tree_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftTask(_message.Message):
    __slots__ = ("request_id", "keep", "context_delta", "k", "branching", "sampling", "traceparent", "tracestate", "score", "score_from", "stop_below", "context_probs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    BRANCHING_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FROM_FIELD_NUMBER: _ClassVar[int]
    STOP_BELOW_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_PROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    keep: int
    context_delta: _containers.RepeatedScalarFieldContainer[int]
    k: int
    branching: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    traceparent: str
    tracestate: str
    score: bool
    score_from: int
    stop_below: float
    context_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., keep: _Optional[int] = ..., context_delta: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., branching: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., score: _Optional[bool] = ..., score_from: _Optional[int] = ..., stop_below: _Optional[float] = ..., context_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("batch_id", "tasks", "release")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    tasks: _containers.RepeatedCompositeFieldContainer[DraftTask]
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, batch_id: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[DraftTask, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("request_id", "tree", "resync", "score_matches", "score_positions", "score_acceptance", "score_acceptance_positions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    SCORE_MATCHES_FIELD_NUMBER: _ClassVar[int]
    SCORE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SCORE_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    SCORE_ACCEPTANCE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tree: _token_tree_pb2.TokenTree
    resync: bool
    score_matches: int
    score_positions: int
    score_acceptance: float
    score_acceptance_positions: int
    def __init__(self, request_id: _Optional[str] = ..., tree: _Optional[_Union[_token_tree_pb2.TokenTree, _Mapping]] = ..., resync: _Optional[bool] = ..., score_matches: _Optional[int] = ..., score_positions: _Optional[int] = ..., score_acceptance: _Optional[float] = ..., score_acceptance_positions: _Optional[int] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("batch_id", "results", "draft_seconds", "free_blocks", "num_blocks")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    results: _containers.RepeatedCompositeFieldContainer[DraftResult]
    draft_seconds: float
    free_blocks: int
    num_blocks: int
    def __init__(self, batch_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[DraftResult, _Mapping]]] = ..., draft_seconds: _Optional[float] = ..., free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class GetDrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDrafterInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _model_info_pb2.ModelInfo
    def __init__(self, info: _Optional[_Union[_model_info_pb2.ModelInfo, _Mapping]] = ...) -> None: ...
