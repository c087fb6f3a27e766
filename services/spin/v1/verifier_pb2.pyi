from spin.v1 import model_info_pb2 as _model_info_pb2
from spin.v1 import sampling_pb2 as _sampling_pb2
from spin.v1 import token_tree_pb2 as _token_tree_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyTask(_message.Message):
    __slots__ = ("request_id", "keep", "context_delta", "tree", "sampling", "traceparent", "tracestate", "logprobs", "head", "allowed", "steps", "stop_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    keep: int
    context_delta: _containers.RepeatedScalarFieldContainer[int]
    tree: _token_tree_pb2.TokenTree
    sampling: _sampling_pb2.SamplingParams
    traceparent: str
    tracestate: str
    logprobs: int
    head: HeadAsk
    allowed: TokenMask
    steps: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., keep: _Optional[int] = ..., context_delta: _Optional[_Iterable[int]] = ..., tree: _Optional[_Union[_token_tree_pb2.TokenTree, _Mapping]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., logprobs: _Optional[int] = ..., head: _Optional[_Union[HeadAsk, _Mapping]] = ..., allowed: _Optional[_Union[TokenMask, _Mapping]] = ..., steps: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenMask(_message.Message):
    __slots__ = ("bits", "words_per_row")
    BITS_FIELD_NUMBER: _ClassVar[int]
    WORDS_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    bits: bytes
    words_per_row: int
    def __init__(self, bits: _Optional[bytes] = ..., words_per_row: _Optional[int] = ...) -> None: ...

class HeadAsk(_message.Message):
    __slots__ = ("name", "k", "stored")
    NAME_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    name: str
    k: int
    stored: int
    def __init__(self, name: _Optional[str] = ..., k: _Optional[int] = ..., stored: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("batch_id", "tasks", "release")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    tasks: _containers.RepeatedCompositeFieldContainer[VerifyTask]
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, batch_id: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[VerifyTask, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("request_id", "tokens", "num_accepted", "resync", "preempted", "logprobs", "token_probs", "head_draft")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DRAFT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    resync: bool
    preempted: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.TokenLogprobs]
    token_probs: _containers.RepeatedScalarFieldContainer[float]
    head_draft: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., resync: _Optional[bool] = ..., preempted: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_sampling_pb2.TokenLogprobs, _Mapping]]] = ..., token_probs: _Optional[_Iterable[float]] = ..., head_draft: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("batch_id", "results", "verify_seconds", "free_blocks", "num_blocks", "head_seconds")
    class HeadSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    verify_seconds: float
    free_blocks: int
    num_blocks: int
    head_seconds: _containers.ScalarMap[str, float]
    def __init__(self, batch_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., verify_seconds: _Optional[float] = ..., free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., head_seconds: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GetVerifierInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetVerifierInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _model_info_pb2.ModelInfo
    def __init__(self, info: _Optional[_Union[_model_info_pb2.ModelInfo, _Mapping]] = ...) -> None: ...
