from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenTree(_message.Message):
    __slots__ = ("tokens", "parents", "probs", "second")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    SECOND_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedCompositeFieldContainer[DraftDistribution]
    second: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[_Union[DraftDistribution, _Mapping]]] = ..., second: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("token_ids", "dense_f16", "token_probs_f16")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DENSE_F16_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROBS_F16_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    dense_f16: bytes
    token_probs_f16: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., dense_f16: _Optional[bytes] = ..., token_probs_f16: _Optional[bytes] = ...) -> None: ...
