export type NoParams = Record<string, never>;
export interface CapabilitiesResult {
    protocol_version: string;
    worker_version: string;
    pid: number;
    backends: BackendInfo[];
    methods: string[];
    notifications: string[];
    framing: FramingInfo;
    limits: Limits;
    model: ModelInfo | null;
}
export interface BackendInfo {
    name: string;
    description: string;
    available: boolean;
    reason: string | null;
}
export interface FramingInfo {
    supported: string[];
    replies: string | null;
}
export interface Limits {
    max_message_bytes: number;
    outbox_messages: number;
    max_batch: number;
}
export interface ModelInfo {
    model: string;
    backend: string;
    path: string | null;
    vocab_size: number;
    context_length: number;
    special_tokens: SpecialToken[];
    has_chat_template: boolean;
    device: string;
    dtype: string;
    quantization: string;
    tool_calls: ToolCallSupport;
    load_time_ms: number;
    /** Default `null`. */
    resident_bytes?: number | null;
}
export interface SpecialToken {
    role: string;
    id: number;
    text: string;
}
/** How generate passes ``tools`` to this model and reads its calls back. */
export interface ToolCallSupport {
    template_takes_tools: boolean;
    format: string | null;
    forced: boolean;
}
export interface LoadParams {
    /** Default `"default"`. */
    model?: string;
    /** Default `"transformers"`. */
    backend?: string;
    /** Default `"cpu"`. */
    device?: string;
    /** Default `"auto"`. */
    dtype?: "auto" | "bfloat16" | "float16" | "float32";
    /** Default `"auto"`. */
    quantization?: "auto" | "gguf" | "int4" | "int8" | "none";
    /** Default `false`. */
    trust_remote_code?: boolean;
    /** minimum 0; maximum 60000. Default `0`. */
    token_delay_ms?: number;
    /** minLength 1; maxLength 2048. Default `null`. */
    base_url?: string | null;
    /** minLength 1; maxLength 256. Default `null`. */
    api_key_env?: string | null;
    /** exclusiveMinimum 0; maximum 3600. Default `120`. */
    stall_timeout_s?: number;
    /** Default `false`. */
    progress?: boolean;
}
export interface UnloadResult {
    unloaded: boolean;
    model: string | null;
}
export interface TokenizeParams {
    text: string;
    /** Default `true`. */
    add_special_tokens?: boolean;
}
export interface TokenizeResult {
    tokens: number[];
    count: number;
}
export interface DetokenizeParams {
    /** items: minimum 0. */
    tokens: number[];
    /** Default `false`. */
    skip_special_tokens?: boolean;
}
export interface DetokenizeResult {
    text: string;
}
export interface RenderParams {
    /** minItems 1. */
    messages: ChatMessage[];
    /** Default `null`. */
    tools?: Tool[] | null;
    /** Default `true`. */
    add_generation_prompt?: boolean;
}
export interface ChatMessage {
    role: string;
    content: string;
    /** Default `null`. */
    name?: string | null;
    /** Default `null`. */
    tool_call_id?: string | null;
    /** Default `null`. */
    tool_calls?: MessageToolCall[] | null;
}
/** A call an earlier assistant message made, as the chat template receives it. */
export interface MessageToolCall {
    /** Default `null`. */
    id?: string | null;
    /** Default `"function"`. */
    type?: "function";
    function: CalledFunction;
}
export interface CalledFunction {
    name: string;
    arguments: Record<string, unknown> | string;
}
/** A tool the model may call, in OpenAI's shape. */
export interface Tool {
    /** Default `"function"`. */
    type?: "function";
    function: ToolFunction;
}
export interface ToolFunction {
    /** pattern `^[A-Za-z0-9_.:/-]{1,256}$(?!\n)`. */
    name: string;
    /** Default `null`. */
    description?: string | null;
    /** Default `null`. */
    parameters?: Record<string, unknown> | null;
}
export interface RenderResult {
    text: string;
    tokens: number[];
    count: number;
}
export interface GenerateParams {
    /** Default `null`. */
    prompt?: string | null;
    /** items: minimum 0. Default `null`. */
    tokens?: number[] | null;
    /** minItems 1. Default `null`. */
    messages?: ChatMessage[] | null;
    /** Default `null`. */
    tools?: Tool[] | null;
    /** Default `true`. */
    add_special_tokens?: boolean;
    /** minimum 1. Default `256`. */
    max_tokens?: number;
    /** minimum 0. Default `0`. */
    temperature?: number;
    /** exclusiveMinimum 0; maximum 1. Default `1`. */
    top_p?: number;
    /** minimum 0. Default `0`. */
    top_k?: number;
    /** minimum 0; maximum 1. Default `0`. */
    min_p?: number;
    /** exclusiveMinimum 0. Default `1`. */
    repetition_penalty?: number;
    /** minimum -9223372036854776000; maximum 9223372036854776000. Default `null`. */
    seed?: number | null;
    /** maxItems 32; items: minLength 1; items: maxLength 1024. Default `[]`. */
    stop?: string[];
    /** Default `true`. */
    stream?: boolean;
    /** minimum 1. Default `null`. */
    stream_window?: number | null;
    /** pattern `^(auto|(memory://)?[A-Za-z0-9_-][A-Za-z0-9._-]{0,127})$(?!\n)`. Default `null`. */
    cache?: string | null;
    /** minimum 0. Default `null`. */
    cache_trim_tokens?: number | null;
    /** Default `null`. */
    response_format?: TextFormat | JsonObjectFormat | JsonSchemaFormat | null;
    /** Default `"auto"`. */
    tool_choice?: "auto" | "none" | "required" | NamedToolChoice;
    /** Default `true`. */
    parallel_tool_calls?: boolean;
    /** Default `null`. */
    draft?: PromptLookup | null;
}
export interface TextFormat {
    type: "text";
}
export interface JsonObjectFormat {
    type: "json_object";
}
export interface JsonSchemaFormat {
    type: "json_schema";
    json_schema: JsonSchemaSpec;
}
export interface JsonSchemaSpec {
    /** Default `"response"`. */
    name?: string;
    /** Default `{}`. */
    schema?: Record<string, unknown>;
    /** Default `true`. */
    strict?: boolean;
    /** Default `null`. */
    description?: string | null;
}
export interface NamedToolChoice {
    /** Default `"function"`. */
    type?: "function";
    function: ToolName;
}
export interface ToolName {
    name: string;
}
/** Draft tokens from the sequence itself: after its last n tokens, those that followed their latest earlier occurrence. The model checks a draft in one pass and the output is the same as without it. */
export interface PromptLookup {
    method: "prompt_lookup";
    /** minimum 1; maximum 64. Default `8`. */
    draft_tokens?: number;
    /** minimum 1; maximum 16. Default `3`. */
    ngram_max?: number;
    /** minimum 1; maximum 16. Default `2`. */
    ngram_min?: number;
}
export interface GenerateResult {
    text: string;
    tokens: number[];
    content: string;
    reasoning: string;
    tool_calls: ToolCall[];
    finish_reason: "cancelled" | "length" | "stop" | "tool_calls";
    stop_reason: StopReason;
    usage: Usage;
    timings: Timings;
    cache: CacheUse | null;
}
/** A call the model made, parsed from its output. */
export interface ToolCall {
    id: string;
    name: string | null;
    arguments: Record<string, unknown> | null;
    raw: string;
    error: string | null;
}
export interface StopReason {
    kind: "cancelled" | "eos" | "max_tokens" | "stop_string";
    token: number | null;
    stop: string | null;
}
export interface Usage {
    prompt_tokens: number;
    completion_tokens: number;
    cache_read_tokens: number;
    cache_write_tokens: number;
    reasoning_tokens: number;
}
export interface Timings {
    queued_ms: number;
    prompt_ms: number;
    decode_ms: number;
    total_ms: number;
    tokens_per_second: number;
    draft_tokens: number;
    draft_accepted_tokens: number;
}
/** What a generate did with its cache. */
export interface CacheUse {
    mode: "auto" | "ref";
    ref: string | null;
    reused_tokens: number;
    reason: string | null;
    skipped: SkippedCache[];
    stored: string | null;
    stored_tokens: number;
    store_reason: string | null;
}
export interface SkippedCache {
    ref: string;
    reason: string;
}
export interface PrefillParams {
    /** Default `null`. */
    prompt?: string | null;
    /** items: minimum 0. Default `null`. */
    tokens?: number[] | null;
    /** minItems 1. Default `null`. */
    messages?: ChatMessage[] | null;
    /** Default `null`. */
    tools?: Tool[] | null;
    /** Default `true`. */
    add_special_tokens?: boolean;
    /** Default `true`. */
    add_generation_prompt?: boolean;
    /** pattern `^(auto|(memory://)?[A-Za-z0-9_-][A-Za-z0-9._-]{0,127})$(?!\n)`. */
    cache: string;
    /** pattern `^(?!auto$)(memory://)?[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$(?!\n)`. Default `null`. */
    base?: string | null;
    /** minimum 0. Default `null`. */
    trim_to_tokens?: number | null;
    /** items: minimum 0. Default `[]`. */
    prefix_offsets?: number[];
    /** Default `[]`. */
    prefix_hashes?: string[];
}
export interface PrefillResult {
    cache: string;
    token_count: number;
    cache_read_tokens: number;
    cache_write_tokens: number;
    bytes: number;
    time_ms: number;
}
export interface CacheListResult {
    caches: CacheInfo[];
    total_bytes: number;
    max_bytes: number | null;
}
export interface CacheInfo {
    cache: string;
    token_count: number;
    bytes: number;
    model_id: string;
    created_by: string;
    last_used: number;
    prefix_offsets: number[];
    prefix_hashes: string[];
}
export interface CacheRefParams {
    /** pattern `^(?!auto$)(memory://)?[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$(?!\n)`. */
    cache: string;
}
export interface CacheDeleteResult {
    deleted: boolean;
}
export interface ModelsListResult {
    models: ModelEntry[];
    searched: SearchedPlace[];
    truncated: boolean;
}
/** A model found on this machine, described from its headers and manifests (no weights read). */
export interface ModelEntry {
    reference: string;
    source: "huggingface" | "models-dir" | "node-llama-cpp" | "ollama";
    path: string;
    format: "gguf" | "transformers";
    architecture: string | null;
    parameters: number | null;
    quantization: string | null;
    size_bytes: number;
    context_length: number | null;
    has_chat_template: boolean;
    tool_calls: ToolCallSupport | null;
    loadable: boolean;
    reason: string | null;
}
/** A directory models/list looked in. */
export interface SearchedPlace {
    source: "huggingface" | "models-dir" | "node-llama-cpp" | "ollama";
    path: string;
    exists: boolean;
    models: number;
    note: string | null;
}
export interface CancelParams {
    id: number | string;
}
export interface CancelResult {
    cancelled: boolean;
    state: "queued" | "running" | "unknown";
}
/** params of the generate/chunk notification; counts are cumulative. */
export interface GenerateChunk {
    id: number | string;
    index: number;
    text: string;
    tokens: number[];
    generated_tokens: number;
    prompt_tokens: number;
    cache_read_tokens: number;
    content: string;
    reasoning: string;
    tool_calls: ToolCall[];
}
/** params of the prefill/progress notification, sent after each chunk of a long prefill. */
export interface PrefillProgress {
    id: number | string;
    processed_tokens: number;
    total_tokens: number;
    cache_read_tokens: number;
}
/** params of the load/progress notification: a stage of a load, as it goes. */
export interface LoadProgress {
    id: number | string;
    stage: "building_kernel" | "dequantizing" | "hashing" | "quantizing";
    done: number;
    total: number;
    unit: "bytes" | "steps" | "tensors";
}
export interface AckParams {
    id: number | string;
    /** minimum 0. */
    index: number;
}
/** The protocol version these types describe (schemas/index.json). */
export declare const PROTOCOL_VERSION = "1.0";
/** Every method: its params and its result. */
export interface Methods {
    /** What this worker speaks and can run. */
    "capabilities": {
        params: NoParams;
        result: CapabilitiesResult;
    };
    /** Load a model, replacing any loaded one. */
    "load": {
        params: LoadParams;
        result: ModelInfo;
    };
    /** Unload the model and free its memory. */
    "unload": {
        params: NoParams;
        result: UnloadResult;
    };
    /** Text to token ids. */
    "tokenize": {
        params: TokenizeParams;
        result: TokenizeResult;
    };
    /** Token ids to text. */
    "detokenize": {
        params: DetokenizeParams;
        result: DetokenizeResult;
    };
    /** Chat messages to prompt text and tokens. */
    "render": {
        params: RenderParams;
        result: RenderResult;
    };
    /** Generate a continuation, streaming chunks. */
    "generate": {
        params: GenerateParams;
        result: GenerateResult;
    };
    /** Compute a prompt's KV cache once and store it. */
    "prefill": {
        params: PrefillParams;
        result: PrefillResult;
    };
    /** The stored caches, most recently used first. */
    "cache/list": {
        params: NoParams;
        result: CacheListResult;
    };
    /** One cache's header, without loading its tensors. */
    "cache/info": {
        params: CacheRefParams;
        result: CacheInfo;
    };
    /** Delete a cache. */
    "cache/delete": {
        params: CacheRefParams;
        result: CacheDeleteResult;
    };
    /** The models on this machine that load can name. */
    "models/list": {
        params: NoParams;
        result: ModelsListResult;
    };
    /** Cancel a queued or running request. */
    "cancel": {
        params: CancelParams;
        result: CancelResult;
    };
    /** Finish up; answers after every earlier request. */
    "shutdown": {
        params: NoParams;
        result: null;
    };
}
export type MethodName = keyof Methods;
/** Notifications the worker sends to the host: method → params. */
export interface WorkerNotifications {
    "generate/chunk": GenerateChunk;
    "prefill/progress": PrefillProgress;
    "load/progress": LoadProgress;
}
/** Notifications the host sends to the worker: method → params. */
export interface HostNotifications {
    "$/cancelRequest": CancelParams;
    "generate/ack": AckParams;
    "exit": NoParams;
}
/** An error's `data.kind`: the protocol's stable name for it, here with its JSON-RPC code (docs/PROTOCOL.md §12). */
export type ErrorKind = "parse_error" | "message_too_large" | "invalid_request" | "batch_not_supported" | "duplicate_id" | "method_not_found" | "invalid_params" | "internal_error" | "request_cancelled" | "shutting_down" | "model_not_loaded" | "model_load_failed" | "model_not_found" | "backend_not_found" | "backend_unavailable" | "context_overflow" | "unsupported" | "cache_not_found" | "cache_identity_mismatch" | "cache_corrupt" | "cache_prefix_mismatch" | "cache_too_large" | "cache_storage_failed" | "engine_unreachable" | "engine_auth_failed" | "model_not_served" | "engine_overloaded" | "engine_error" | "engine_stalled";
