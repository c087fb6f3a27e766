from spin.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_UNSPECIFIED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_AUTO: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]
    SPECULATION_MODE_DRAFTER: _ClassVar[SpeculationMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
SPECULATION_MODE_UNSPECIFIED: SpeculationMode
SPECULATION_MODE_AUTO: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
SPECULATION_MODE_DRAFTER: SpeculationMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason

class Speculation(_message.Message):
    __slots__ = ("mode", "drafter", "k", "early_stop")
    MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOP_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationMode
    drafter: str
    k: int
    early_stop: bool
    def __init__(self, mode: _Optional[_Union[SpeculationMode, str]] = ..., drafter: _Optional[str] = ..., k: _Optional[int] = ..., early_stop: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "max_tokens", "sampling", "stop", "speculation", "ignore_eos", "logprobs", "grammar", "prediction")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: _sampling_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: Speculation
    ignore_eos: bool
    logprobs: int
    grammar: Grammar
    prediction: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., prediction: _Optional[str] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "source")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    source: str
    def __init__(self, kind: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class DrafterUsage(_message.Message):
    __slots__ = ("drafter", "steps", "draft_tokens", "accepted_tokens")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    steps: int
    draft_tokens: int
    accepted_tokens: int
    def __init__(self, drafter: _Optional[str] = ..., steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("steps", "steps_without_speculation", "draft_tokens", "accepted_tokens", "tau", "drafters")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_WITHOUT_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    steps_without_speculation: int
    draft_tokens: int
    accepted_tokens: int
    tau: float
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterUsage]
    def __init__(self, steps: _Optional[int] = ..., steps_without_speculation: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., tau: _Optional[float] = ..., drafters: _Optional[_Iterable[_Union[DrafterUsage, _Mapping]]] = ...) -> None: ...

class StepInfo(_message.Message):
    __slots__ = ("drafter", "k", "draft_tokens", "accepted_tokens", "step_seconds", "predicted_step_seconds", "batch_size", "forwards")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    k: int
    draft_tokens: int
    accepted_tokens: int
    step_seconds: float
    predicted_step_seconds: float
    batch_size: int
    forwards: int
    def __init__(self, drafter: _Optional[str] = ..., k: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., predicted_step_seconds: _Optional[float] = ..., batch_size: _Optional[int] = ..., forwards: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "speculation", "step", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    speculation: SpeculationStats
    step: StepInfo
    logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ..., step: _Optional[_Union[StepInfo, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_sampling_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...
