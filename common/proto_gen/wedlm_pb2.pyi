from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_CURRENT: _ClassVar[ProtocolVersion]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_CURRENT: ProtocolVersion
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("batch_id", "seq_ids", "committed", "widths", "keep", "filled", "positions", "hidden", "reply_rows", "plan_epoch", "stage_compute_s", "forks", "slot_offsets", "canvas_extent")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    WIDTHS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    FILLED_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    REPLY_ROWS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STAGE_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CANVAS_EXTENT_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    committed: _containers.RepeatedScalarFieldContainer[int]
    widths: _containers.RepeatedScalarFieldContainer[int]
    keep: _containers.RepeatedScalarFieldContainer[int]
    filled: bytes
    positions: _containers.RepeatedScalarFieldContainer[int]
    hidden: Tensor
    reply_rows: RowSelection
    plan_epoch: int
    stage_compute_s: _containers.RepeatedScalarFieldContainer[float]
    forks: _containers.RepeatedCompositeFieldContainer[KVFork]
    slot_offsets: bytes
    canvas_extent: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., committed: _Optional[_Iterable[int]] = ..., widths: _Optional[_Iterable[int]] = ..., keep: _Optional[_Iterable[int]] = ..., filled: _Optional[bytes] = ..., positions: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., reply_rows: _Optional[_Union[RowSelection, _Mapping]] = ..., plan_epoch: _Optional[int] = ..., stage_compute_s: _Optional[_Iterable[float]] = ..., forks: _Optional[_Iterable[_Union[KVFork, _Mapping]]] = ..., slot_offsets: _Optional[bytes] = ..., canvas_extent: _Optional[_Iterable[int]] = ...) -> None: ...

class KVFork(_message.Message):
    __slots__ = ("seq_id", "source", "length")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    source: int
    length: int
    def __init__(self, seq_id: _Optional[int] = ..., source: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class RowSelection(_message.Message):
    __slots__ = ("per_row", "slots")
    PER_ROW_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    per_row: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, per_row: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("batch_id", "hidden", "compute_s", "queue_s", "stage_compute_s")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    STAGE_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    hidden: Tensor
    compute_s: float
    queue_s: float
    stage_compute_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, batch_id: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., compute_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., stage_compute_s: _Optional[_Iterable[float]] = ...) -> None: ...

class RelayReply(_message.Message):
    __slots__ = ("received",)
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    received: int
    def __init__(self, received: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("plan_epoch", "next_stage", "prev_stage")
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_STAGE_FIELD_NUMBER: _ClassVar[int]
    PREV_STAGE_FIELD_NUMBER: _ClassVar[int]
    plan_epoch: int
    next_stage: str
    prev_stage: str
    def __init__(self, plan_epoch: _Optional[int] = ..., next_stage: _Optional[str] = ..., prev_stage: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released", "kv_sequences")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    KV_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    released: int
    kv_sequences: int
    def __init__(self, released: _Optional[int] = ..., kv_sequences: _Optional[int] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("layer_start", "layer_end", "model_source", "fetch_only", "kv_bits", "kv_group_size", "group")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    MODEL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    FETCH_ONLY_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    model_source: str
    fetch_only: bool
    kv_bits: int
    kv_group_size: int
    group: TensorGroup
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., model_source: _Optional[str] = ..., fetch_only: _Optional[bool] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ..., group: _Optional[_Union[TensorGroup, _Mapping]] = ...) -> None: ...

class TensorGroup(_message.Message):
    __slots__ = ("rank", "size", "hosts", "backend", "epoch", "rdma_devices")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RDMA_DEVICES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    size: int
    hosts: _containers.RepeatedScalarFieldContainer[str]
    backend: str
    epoch: int
    rdma_devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., size: _Optional[int] = ..., hosts: _Optional[_Iterable[str]] = ..., backend: _Optional[str] = ..., epoch: _Optional[int] = ..., rdma_devices: _Optional[_Iterable[str]] = ...) -> None: ...

class RdmaPort(_message.Message):
    __slots__ = ("device", "domain_uuid", "peer_uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_UUID_FIELD_NUMBER: _ClassVar[int]
    PEER_UUID_FIELD_NUMBER: _ClassVar[int]
    device: str
    domain_uuid: str
    peer_uuid: str
    def __init__(self, device: _Optional[str] = ..., domain_uuid: _Optional[str] = ..., peer_uuid: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class EchoReply(_message.Message):
    __slots__ = ("received",)
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    received: int
    def __init__(self, received: _Optional[int] = ...) -> None: ...

class ProbeLinkRequest(_message.Message):
    __slots__ = ("peer", "timeout_s")
    PEER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    peer: str
    timeout_s: float
    def __init__(self, peer: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class LinkFigures(_message.Message):
    __slots__ = ("a", "b", "rtt_s", "bandwidth", "small_s", "large_s", "error")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    SMALL_S_FIELD_NUMBER: _ClassVar[int]
    LARGE_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    rtt_s: float
    bandwidth: float
    small_s: float
    large_s: float
    error: str
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., rtt_s: _Optional[float] = ..., bandwidth: _Optional[float] = ..., small_s: _Optional[float] = ..., large_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ProbeLinkReply(_message.Message):
    __slots__ = ("link", "read_bandwidth")
    LINK_FIELD_NUMBER: _ClassVar[int]
    READ_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    link: LinkFigures
    read_bandwidth: float
    def __init__(self, link: _Optional[_Union[LinkFigures, _Mapping]] = ..., read_bandwidth: _Optional[float] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("node_id", "cluster", "protocol_version", "model_identity", "model_name", "num_layers", "has_layers", "layer_start", "layer_end", "fixed_range", "device", "memory_total", "memory_available", "layer_bytes", "kv_bytes_per_token", "kv_sequences", "kv_bytes", "hidden_dtype", "plan_epoch", "next_stage", "fetches_layers", "cache_bytes", "kv_bits", "kv_group_size", "group_port", "group_backends", "group_rank", "group_size", "group_backend", "group_error", "rdma_ports", "read_bandwidth")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HAS_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    FIXED_RANGE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_STAGE_FIELD_NUMBER: _ClassVar[int]
    FETCHES_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_BACKEND_FIELD_NUMBER: _ClassVar[int]
    GROUP_ERROR_FIELD_NUMBER: _ClassVar[int]
    RDMA_PORTS_FIELD_NUMBER: _ClassVar[int]
    READ_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cluster: str
    protocol_version: int
    model_identity: str
    model_name: str
    num_layers: int
    has_layers: bool
    layer_start: int
    layer_end: int
    fixed_range: bool
    device: str
    memory_total: int
    memory_available: int
    layer_bytes: int
    kv_bytes_per_token: int
    kv_sequences: int
    kv_bytes: int
    hidden_dtype: str
    plan_epoch: int
    next_stage: str
    fetches_layers: bool
    cache_bytes: int
    kv_bits: int
    kv_group_size: int
    group_port: int
    group_backends: _containers.RepeatedScalarFieldContainer[str]
    group_rank: int
    group_size: int
    group_backend: str
    group_error: str
    rdma_ports: _containers.RepeatedCompositeFieldContainer[RdmaPort]
    read_bandwidth: float
    def __init__(self, node_id: _Optional[str] = ..., cluster: _Optional[str] = ..., protocol_version: _Optional[int] = ..., model_identity: _Optional[str] = ..., model_name: _Optional[str] = ..., num_layers: _Optional[int] = ..., has_layers: _Optional[bool] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., fixed_range: _Optional[bool] = ..., device: _Optional[str] = ..., memory_total: _Optional[int] = ..., memory_available: _Optional[int] = ..., layer_bytes: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., kv_sequences: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., hidden_dtype: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., next_stage: _Optional[str] = ..., fetches_layers: _Optional[bool] = ..., cache_bytes: _Optional[int] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ..., group_port: _Optional[int] = ..., group_backends: _Optional[_Iterable[str]] = ..., group_rank: _Optional[int] = ..., group_size: _Optional[int] = ..., group_backend: _Optional[str] = ..., group_error: _Optional[str] = ..., rdma_ports: _Optional[_Iterable[_Union[RdmaPort, _Mapping]]] = ..., read_bandwidth: _Optional[float] = ...) -> None: ...

class LayerManifestRequest(_message.Message):
    __slots__ = ("layers", "with_sha256", "node_id", "fetch_bytes", "received_bytes")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    WITH_SHA256_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    with_sha256: _containers.RepeatedScalarFieldContainer[int]
    node_id: str
    fetch_bytes: int
    received_bytes: int
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., with_sha256: _Optional[_Iterable[int]] = ..., node_id: _Optional[str] = ..., fetch_bytes: _Optional[int] = ..., received_bytes: _Optional[int] = ...) -> None: ...

class LayerFile(_message.Message):
    __slots__ = ("layer", "name", "size", "sha256")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    layer: int
    name: str
    size: int
    sha256: str
    def __init__(self, layer: _Optional[int] = ..., name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class LayerManifestReply(_message.Message):
    __slots__ = ("model_identity", "model_name", "config_json", "files")
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model_identity: str
    model_name: str
    config_json: bytes
    files: _containers.RepeatedCompositeFieldContainer[LayerFile]
    def __init__(self, model_identity: _Optional[str] = ..., model_name: _Optional[str] = ..., config_json: _Optional[bytes] = ..., files: _Optional[_Iterable[_Union[LayerFile, _Mapping]]] = ...) -> None: ...

class FetchLayerRequest(_message.Message):
    __slots__ = ("layer", "offset", "node_id")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    layer: int
    offset: int
    node_id: str
    def __init__(self, layer: _Optional[int] = ..., offset: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class LayerChunk(_message.Message):
    __slots__ = ("offset", "data", "sha256")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    sha256: str
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "mode", "window", "threshold", "one_by_one", "penalty", "temperature", "top_p", "top_k", "max_tokens", "stop_ids", "stop", "seed", "deadline_s", "draft", "sampler", "steps", "logprobs", "output_format")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ONE_BY_ONE_FIELD_NUMBER: _ClassVar[int]
    PENALTY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: bool
    mode: str
    window: int
    threshold: float
    one_by_one: bool
    penalty: float
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    deadline_s: float
    draft: str
    sampler: str
    steps: int
    logprobs: int
    output_format: OutputFormat
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[bool] = ..., mode: _Optional[str] = ..., window: _Optional[int] = ..., threshold: _Optional[float] = ..., one_by_one: _Optional[bool] = ..., penalty: _Optional[float] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., deadline_s: _Optional[float] = ..., draft: _Optional[str] = ..., sampler: _Optional[str] = ..., steps: _Optional[int] = ..., logprobs: _Optional[int] = ..., output_format: _Optional[_Union[OutputFormat, _Mapping]] = ...) -> None: ...

class OutputFormat(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("id", "logprob", "top")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("id", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "forwards", "tokens_per_forward", "prefill_s", "decode_s", "queue_s", "drafted_tokens", "accepted_drafts", "cached_tokens", "mode", "warning")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_FORWARD_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    forwards: int
    tokens_per_forward: float
    prefill_s: float
    decode_s: float
    queue_s: float
    drafted_tokens: int
    accepted_drafts: int
    cached_tokens: int
    mode: str
    warning: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., forwards: _Optional[int] = ..., tokens_per_forward: _Optional[float] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., drafted_tokens: _Optional[int] = ..., accepted_drafts: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., mode: _Optional[str] = ..., warning: _Optional[str] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "tokens", "text", "stats", "error", "error_kind", "logprobs")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    text: str
    stats: GenerationStats
    error: str
    error_kind: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, finish_reason: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., error: _Optional[str] = ..., error_kind: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("tokens", "final")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenChunk
    final: Final
    def __init__(self, tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("ids", "text", "logprobs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class WaitJobRequest(_message.Message):
    __slots__ = ("job_id", "timeout_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    timeout_s: float
    def __init__(self, job_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "state", "result", "committed_tokens", "created_at")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    result: Final
    committed_tokens: int
    created_at: float
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., result: _Optional[_Union[Final, _Mapping]] = ..., committed_tokens: _Optional[int] = ..., created_at: _Optional[float] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HopTiming(_message.Message):
    __slots__ = ("compute_s", "roundtrip_s")
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    ROUNDTRIP_S_FIELD_NUMBER: _ClassVar[int]
    compute_s: float
    roundtrip_s: float
    def __init__(self, compute_s: _Optional[float] = ..., roundtrip_s: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("info", "address", "source", "health", "detail", "timing", "group_leader")
    INFO_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    GROUP_LEADER_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    address: str
    source: str
    health: str
    detail: str
    timing: HopTiming
    group_leader: str
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., address: _Optional[str] = ..., source: _Optional[str] = ..., health: _Optional[str] = ..., detail: _Optional[str] = ..., timing: _Optional[_Union[HopTiming, _Mapping]] = ..., group_leader: _Optional[str] = ...) -> None: ...

class ClusterStatusReply(_message.Message):
    __slots__ = ("cluster", "state", "workers", "running", "queued", "model_identity", "waiting_for", "local_layers", "plan_epoch", "fetches", "prefix_cache", "max_running", "max_running_reason", "default_mode", "kv_budget_tokens", "plan_note", "links", "read_bandwidth", "limits", "coordinator")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REASON_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLAN_NOTE_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    READ_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    state: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    running: int
    queued: int
    model_identity: str
    waiting_for: str
    local_layers: str
    plan_epoch: int
    fetches: _containers.RepeatedCompositeFieldContainer[LayerFetch]
    prefix_cache: PrefixCacheStatus
    max_running: int
    max_running_reason: str
    default_mode: str
    kv_budget_tokens: int
    plan_note: str
    links: _containers.RepeatedCompositeFieldContainer[LinkFigures]
    read_bandwidth: float
    limits: RequestLimits
    coordinator: CoordinatorMember
    def __init__(self, cluster: _Optional[str] = ..., state: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., model_identity: _Optional[str] = ..., waiting_for: _Optional[str] = ..., local_layers: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., fetches: _Optional[_Iterable[_Union[LayerFetch, _Mapping]]] = ..., prefix_cache: _Optional[_Union[PrefixCacheStatus, _Mapping]] = ..., max_running: _Optional[int] = ..., max_running_reason: _Optional[str] = ..., default_mode: _Optional[str] = ..., kv_budget_tokens: _Optional[int] = ..., plan_note: _Optional[str] = ..., links: _Optional[_Iterable[_Union[LinkFigures, _Mapping]]] = ..., read_bandwidth: _Optional[float] = ..., limits: _Optional[_Union[RequestLimits, _Mapping]] = ..., coordinator: _Optional[_Union[CoordinatorMember, _Mapping]] = ...) -> None: ...

class CoordinatorMember(_message.Message):
    __slots__ = ("name", "address", "device", "memory_total", "memory_available")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    device: str
    memory_total: int
    memory_available: int
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., memory_total: _Optional[int] = ..., memory_available: _Optional[int] = ...) -> None: ...

class RequestLimits(_message.Message):
    __slots__ = ("max_request_bytes", "context_tokens", "max_prompt_chars")
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_CHARS_FIELD_NUMBER: _ClassVar[int]
    max_request_bytes: int
    context_tokens: int
    max_prompt_chars: int
    def __init__(self, max_request_bytes: _Optional[int] = ..., context_tokens: _Optional[int] = ..., max_prompt_chars: _Optional[int] = ...) -> None: ...

class PrefixCacheStatus(_message.Message):
    __slots__ = ("enabled", "entries", "tokens", "capacity_tokens", "lookups", "hits", "hit_tokens", "evictions", "block_tokens")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    entries: int
    tokens: int
    capacity_tokens: int
    lookups: int
    hits: int
    hit_tokens: int
    evictions: int
    block_tokens: int
    def __init__(self, enabled: _Optional[bool] = ..., entries: _Optional[int] = ..., tokens: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class LayerFetch(_message.Message):
    __slots__ = ("node_id", "peer", "bytes_done", "bytes_total", "bytes_per_s", "eta_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peer: str
    bytes_done: int
    bytes_total: int
    bytes_per_s: float
    eta_s: float
    def __init__(self, node_id: _Optional[str] = ..., peer: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., bytes_per_s: _Optional[float] = ..., eta_s: _Optional[float] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoReply(_message.Message):
    __slots__ = ("model_name", "model_type", "model_identity", "num_layers", "hidden_size", "vocab_size", "max_position_embeddings", "mask_token_id", "eos_token_ids", "has_chat_template", "default_mode")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_type: str
    model_identity: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    mask_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    default_mode: str
    def __init__(self, model_name: _Optional[str] = ..., model_type: _Optional[str] = ..., model_identity: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., mask_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: _Optional[bool] = ..., default_mode: _Optional[str] = ...) -> None: ...
