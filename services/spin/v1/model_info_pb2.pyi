from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelInfo(_message.Message):
    __slots__ = ("name", "model_path", "vocab_size", "max_context", "max_requests", "block_size", "num_blocks", "tokenizer", "tokenizer_size", "tokenizer_fingerprint", "device", "dtype", "weight_bytes", "kv_cache_bytes", "step_times", "heads", "head_step_times")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_path: str
    vocab_size: int
    max_context: int
    max_requests: int
    block_size: int
    num_blocks: int
    tokenizer: str
    tokenizer_size: int
    tokenizer_fingerprint: str
    device: str
    dtype: str
    weight_bytes: int
    kv_cache_bytes: int
    step_times: _containers.RepeatedCompositeFieldContainer[StepTime]
    heads: _containers.RepeatedScalarFieldContainer[str]
    head_step_times: _containers.RepeatedCompositeFieldContainer[HeadStepTimes]
    def __init__(self, name: _Optional[str] = ..., model_path: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_requests: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., tokenizer: _Optional[str] = ..., tokenizer_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., step_times: _Optional[_Iterable[_Union[StepTime, _Mapping]]] = ..., heads: _Optional[_Iterable[str]] = ..., head_step_times: _Optional[_Iterable[_Union[HeadStepTimes, _Mapping]]] = ...) -> None: ...

class HeadStepTimes(_message.Message):
    __slots__ = ("head", "step_times")
    HEAD_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    head: str
    step_times: _containers.RepeatedCompositeFieldContainer[StepTime]
    def __init__(self, head: _Optional[str] = ..., step_times: _Optional[_Iterable[_Union[StepTime, _Mapping]]] = ...) -> None: ...

class StepTime(_message.Message):
    __slots__ = ("batch", "tokens", "context_tokens", "seconds", "tree")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    batch: int
    tokens: int
    context_tokens: int
    seconds: float
    tree: bool
    def __init__(self, batch: _Optional[int] = ..., tokens: _Optional[int] = ..., context_tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., tree: _Optional[bool] = ...) -> None: ...
