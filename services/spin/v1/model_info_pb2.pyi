from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ModelInfo(_message.Message):
    __slots__ = ("name", "model_path", "vocab_size", "max_context", "max_requests")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_path: str
    vocab_size: int
    max_context: int
    max_requests: int
    def __init__(self, name: _Optional[str] = ..., model_path: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_requests: _Optional[int] = ...) -> None: ...
