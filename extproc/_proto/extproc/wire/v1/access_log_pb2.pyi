import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import wrappers_pb2 as _wrappers_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AccessLogSocketAddress(_message.Message):
    __slots__ = ("address", "port_value")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_VALUE_FIELD_NUMBER: _ClassVar[int]
    address: str
    port_value: int
    def __init__(self, address: _Optional[str] = ..., port_value: _Optional[int] = ...) -> None: ...

class AccessLogAddress(_message.Message):
    __slots__ = ("socket_address",)
    SOCKET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    socket_address: AccessLogSocketAddress
    def __init__(self, socket_address: _Optional[_Union[AccessLogSocketAddress, _Mapping]] = ...) -> None: ...

class AccessLogCommon(_message.Message):
    __slots__ = ("time_to_first_upstream_rx_byte", "time_to_last_downstream_tx_byte", "upstream_remote_address", "response_flags")
    TIME_TO_FIRST_UPSTREAM_RX_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LAST_DOWNSTREAM_TX_BYTE_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FLAGS_FIELD_NUMBER: _ClassVar[int]
    time_to_first_upstream_rx_byte: _duration_pb2.Duration
    time_to_last_downstream_tx_byte: _duration_pb2.Duration
    upstream_remote_address: AccessLogAddress
    response_flags: ResponseFlags
    def __init__(self, time_to_first_upstream_rx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_last_downstream_tx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., upstream_remote_address: _Optional[_Union[AccessLogAddress, _Mapping]] = ..., response_flags: _Optional[_Union[ResponseFlags, _Mapping]] = ...) -> None: ...

class ResponseFlags(_message.Message):
    __slots__ = ("upstream_request_timeout", "local_reset", "upstream_remote_reset", "upstream_connection_termination", "downstream_connection_termination", "stream_idle_timeout", "upstream_max_stream_duration_reached", "duration_timeout", "upstream_protocol_error", "overload_manager")
    UPSTREAM_REQUEST_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RESET_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_REMOTE_RESET_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_CONNECTION_TERMINATION_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_CONNECTION_TERMINATION_FIELD_NUMBER: _ClassVar[int]
    STREAM_IDLE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_MAX_STREAM_DURATION_REACHED_FIELD_NUMBER: _ClassVar[int]
    DURATION_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_PROTOCOL_ERROR_FIELD_NUMBER: _ClassVar[int]
    OVERLOAD_MANAGER_FIELD_NUMBER: _ClassVar[int]
    upstream_request_timeout: bool
    local_reset: bool
    upstream_remote_reset: bool
    upstream_connection_termination: bool
    downstream_connection_termination: bool
    stream_idle_timeout: bool
    upstream_max_stream_duration_reached: bool
    duration_timeout: bool
    upstream_protocol_error: bool
    overload_manager: bool
    def __init__(self, upstream_request_timeout: _Optional[bool] = ..., local_reset: _Optional[bool] = ..., upstream_remote_reset: _Optional[bool] = ..., upstream_connection_termination: _Optional[bool] = ..., downstream_connection_termination: _Optional[bool] = ..., stream_idle_timeout: _Optional[bool] = ..., upstream_max_stream_duration_reached: _Optional[bool] = ..., duration_timeout: _Optional[bool] = ..., upstream_protocol_error: _Optional[bool] = ..., overload_manager: _Optional[bool] = ...) -> None: ...

class HTTPRequestProperties(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class HTTPResponseProperties(_message.Message):
    __slots__ = ("response_code", "response_body_bytes")
    RESPONSE_CODE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BODY_BYTES_FIELD_NUMBER: _ClassVar[int]
    response_code: _wrappers_pb2.UInt32Value
    response_body_bytes: int
    def __init__(self, response_code: _Optional[_Union[_wrappers_pb2.UInt32Value, _Mapping]] = ..., response_body_bytes: _Optional[int] = ...) -> None: ...

class HTTPAccessLogEntry(_message.Message):
    __slots__ = ("common_properties", "request", "response")
    COMMON_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    common_properties: AccessLogCommon
    request: HTTPRequestProperties
    response: HTTPResponseProperties
    def __init__(self, common_properties: _Optional[_Union[AccessLogCommon, _Mapping]] = ..., request: _Optional[_Union[HTTPRequestProperties, _Mapping]] = ..., response: _Optional[_Union[HTTPResponseProperties, _Mapping]] = ...) -> None: ...

class StreamAccessLogsMessage(_message.Message):
    __slots__ = ("http_logs",)
    class HTTPAccessLogEntries(_message.Message):
        __slots__ = ("log_entry",)
        LOG_ENTRY_FIELD_NUMBER: _ClassVar[int]
        log_entry: _containers.RepeatedCompositeFieldContainer[HTTPAccessLogEntry]
        def __init__(self, log_entry: _Optional[_Iterable[_Union[HTTPAccessLogEntry, _Mapping]]] = ...) -> None: ...
    HTTP_LOGS_FIELD_NUMBER: _ClassVar[int]
    http_logs: StreamAccessLogsMessage.HTTPAccessLogEntries
    def __init__(self, http_logs: _Optional[_Union[StreamAccessLogsMessage.HTTPAccessLogEntries, _Mapping]] = ...) -> None: ...

class StreamAccessLogsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
