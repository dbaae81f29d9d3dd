"""What each method does. Its declaration in worker/policy.py decides when and on which thread."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence
import msgspec

from protocol.envelope import RequestId
from protocol.errors import ErrorKind, RpcError
from protocol.methods import (
    PROTOCOL_VERSION,
    CacheDeleteResult,
    CacheInfo,
    CacheListResult,
    CacheRefParams,
    CancelParams,
    CancelResult,
    PrefillParams,
    PrefillProgress,
    CapabilitiesResult,
    DetokenizeParams,
    DetokenizeResult,
    FramingInfo,
    GenerateChunk,
    GenerateParams,
    Limits,
    LoadParams,
    ModelInfo,
    ModelsListResult,
    NoParams,
    RenderParams,
    RenderResult,
    TokenizeParams,
    TokenizeResult,
    UnloadResult,
)
from protocol.framing import Framing
from worker import __version__, heap, load_progress, model_refs, stopping
from worker.backends import Registry
from worker.backends.base import (
    CachingModel,
    CheckingBackend,
    EngineModel,
    LocalModelBackend,
    Model,
    SideThreadModel,
)

if TYPE_CHECKING:
    from worker.caching import Prefill
    from worker.kvcache.store import CacheStore
from worker.backends.openai.generation import EnginePrefill, EngineStream, check_engine_request
from worker.constraints import output_constraint
from worker.generation import (
    Generation,
    LocalSteps,
    check_draft,
    check_vocabulary,
    prefill_prompt,
    prompt_tokens,
    render_messages,
)

log = logging.getLogger(__name__)


class Context(msgspec.Struct, frozen=True):
    """What a handler may know about the request it serves."""

    id: RequestId
    cancelled: threading.Event
    queued_ms: float
    send_notification: Callable[[str, msgspec.Struct], None]
    acked: Callable[[], int] = lambda: -1  # the last generate/chunk index the host acknowledged
    prompt: list[int] | None = None  # a generate's or prefill's messages, rendered already (Handlers.prompt)
    # Cancels another request in flight (the session's cancel); without a session, none is in flight.
    cancel: Callable[[RequestId], CancelResult] = lambda _: CancelResult(cancelled=False, state="unknown")


def _load_cancelled() -> RpcError:
    return RpcError(ErrorKind.REQUEST_CANCELLED, "The load was cancelled; no model is loaded.")


def _let_go(model: Model) -> None:
    """Close a model that a cancelled load made, as unload closes one."""
    model.close()
    alive = heap.outlives(model)
    del model
    heap.thaw(collect=alive())


class WireInfo(msgspec.Struct, frozen=True):
    """Facts about the connection that ``capabilities`` reports."""

    methods: list[str]
    notifications: list[str]
    framing: Callable[[], Framing | None]
    max_message_bytes: int
    outbox_messages: int
    max_batch: int


class Handlers:
    def __init__(
        self,
        registry: Registry,
        wire: WireInfo,
        *,
        data_dir: Path,
        cache_dir: Path | None = None,
        cache_max_bytes: int | None = None,
        memory_cache_max_bytes: int | None = None,
        restore_reserve_max_bytes: int = 0,
        models_dirs: Sequence[Path] = (),
    ) -> None:
        self._registry = registry
        # read once: what load's references and models/list see stays the same for the worker's life
        self._places = model_refs.ModelPlaces.from_environment(models_dirs)
        self._wire = wire
        self._data_dir = data_dir
        self._cache_dir = cache_dir or data_dir / "caches"
        self._cache_max_bytes = cache_max_bytes
        self._memory_cache_max_bytes = memory_cache_max_bytes
        self._restore_reserve_max_bytes = restore_reserve_max_bytes
        self._cache_store: CacheStore | None = None
        self._model: Model | None = None

    def capabilities(self, ctx: Context, params: NoParams) -> CapabilitiesResult:
        framing = self._wire.framing()
        return CapabilitiesResult(
            protocol_version=PROTOCOL_VERSION,
            worker_version=__version__,
            pid=os.getpid(),
            backends=self._registry.describe(),
            methods=self._wire.methods,
            notifications=self._wire.notifications,
            framing=FramingInfo(supported=[f.value for f in Framing], replies=framing and framing.value),
            limits=Limits(
                max_message_bytes=self._wire.max_message_bytes, outbox_messages=self._wire.outbox_messages,
                max_batch=self._wire.max_batch,
            ),
            model=self._model.info if self._model else None,
        )

    def load(self, ctx: Context, params: LoadParams) -> ModelInfo:
        """A cancel from the unloading of the model before until the backend's load returns ends
        the load (PROTOCOL 9): at once where it waits on another program (a compiler, a server),
        at its next stage or report (load_progress), at the latest when the backend returns; the
        model it made is let go, and none is loaded."""
        backend = self._registry.get(params.backend)
        resolved = None
        if isinstance(backend, LocalModelBackend):  # ollama:, hf: and names in the models directories
            resolved = model_refs.resolve(params.model, self._places, self._data_dir, backend.own_model_names())
            if resolved is not None:
                params = msgspec.structs.replace(params, model=str(resolved.path))
        if isinstance(backend, CheckingBackend):  # before unloading: a typo leaves the current model working
            backend.check(params, data_dir=self._data_dir)
        started = time.perf_counter()
        send = (lambda progress: ctx.send_notification("load/progress", progress)) if params.progress else None
        # Set by the cancel itself (stopping.Stop, under its lock): a cancel that came before this
        # wait began answered "cancelled": false, and the load goes on.
        stopped = threading.Event()
        try:
            with stopping.while_waiting(stopped.set), load_progress.reporting(send, ctx.id, is_cancelled=stopped.is_set):
                self.unload(ctx, NoParams())
                model = backend.load(params, data_dir=self._data_dir)
        except Exception as exc:
            cancelled = isinstance(exc, RpcError) and exc.kind is ErrorKind.REQUEST_CANCELLED
            if stopped.is_set() and not cancelled:  # whatever the backend or a library made of the cancel
                raise _load_cancelled() from exc
            raise
        if stopped.is_set():
            _let_go(model)
            raise _load_cancelled()
        if resolved is not None:  # the host's own words, and the model's own file (not a link to it)
            model.info.model, model.info.path = resolved.reference, str(resolved.file)
        if isinstance(model, CachingModel):
            self._prepare_restores(model)
        self._model = model
        heap.settle()
        model.info.resident_bytes = heap.resident_bytes()
        log.info(
            "loaded %s with backend %s in %.0f ms", params.model, params.backend, (time.perf_counter() - started) * 1e3
        )
        return model.info

    def _prepare_restores(self, model: CachingModel[Any]) -> None:
        """Import the cache modules now, not in the first request that uses a cache, and fill
        the memory for restoring this model's largest stored cache (CacheStore.reserve_for)."""
        import worker.caching  # noqa: F401

        started = time.perf_counter()
        reserved = self._store().reserve_for(model.cache_identity(), self._restore_reserve_max_bytes)
        if reserved:
            took = (time.perf_counter() - started) * 1e3
            log.info("reserved %d bytes for restoring stored caches in %.0f ms", reserved, took)

    def wake_model(self) -> None:
        """The model lane has something to look at: an engine model's step that waits returns.
        Any thread."""
        model = self._model
        if isinstance(model, EngineModel):
            model.wake()

    def unload(self, ctx: Context, params: NoParams) -> UnloadResult:
        model, self._model = self._model, None
        if model is None:
            return UnloadResult(unloaded=False, model=None)
        if self._cache_store is not None:  # memory caches hold the model's tensors: let them go with it
            self._cache_store.release_memory()
        name = model.info.model
        model.close()
        alive = heap.outlives(model)
        del model
        heap.thaw(collect=alive())
        return UnloadResult(unloaded=True, model=name)

    def tokenize(self, ctx: Context, params: TokenizeParams) -> TokenizeResult:
        tokens = self._loaded().tokenize(params.text, add_special_tokens=params.add_special_tokens)
        return TokenizeResult(tokens=tokens, count=len(tokens))

    def detokenize(self, ctx: Context, params: DetokenizeParams) -> DetokenizeResult:
        model = self._loaded()
        check_vocabulary(model, params.tokens, "params.tokens")
        return DetokenizeResult(text=model.detokenize(params.tokens, skip_special_tokens=params.skip_special_tokens))

    def render(self, ctx: Context, params: RenderParams) -> RenderResult:
        text, tokens = render_messages(
            self._loaded(), params.messages, params.tools or [], add_generation_prompt=params.add_generation_prompt
        )
        return RenderResult(text=text, tokens=tokens, count=len(tokens))

    def prompt(self, ctx: Context, params: GenerateParams | PrefillParams) -> list[int] | None:
        """The prompt of a generate or prefill with messages, rendered before its task is made
        (on a render thread: a chat template may take its whole deadline); None where the model
        renders nothing itself (an engine's server renders them)."""
        model = self._loaded()
        if isinstance(model, EngineModel):
            return None
        if isinstance(params, GenerateParams):
            return prompt_tokens(model, params)
        return prefill_prompt(model, params)

    def generate(self, ctx: Context, params: GenerateParams) -> Generation:
        """The generation, ready for the scheduler to feed and step (nothing computed yet; on
        an engine, the request is sent)."""
        from worker.caching import start_generate

        def send_chunk(chunk: GenerateChunk) -> None:
            ctx.send_notification("generate/chunk", chunk)

        started = time.perf_counter()  # the restore of a cache counts as prompt time
        model = self._loaded()
        if isinstance(model, EngineModel):
            check_engine_request(model, params)
            return Generation(
                model, params, EngineStream(model.submit(params), params), request_id=ctx.id,
                is_cancelled=ctx.cancelled.is_set, send_chunk=send_chunk, acked=ctx.acked, queued_ms=ctx.queued_ms,
                started=started,
            )
        prompt = ctx.prompt if ctx.prompt is not None else prompt_tokens(model, params)
        constraint = output_constraint(model, params)
        check_draft(model, params)
        return Generation(
            model,
            params,
            LocalSteps(model, params, prompt, start_generate(self._store(), model, params, prompt), constraint),
            request_id=ctx.id,
            is_cancelled=ctx.cancelled.is_set,
            send_chunk=send_chunk,
            acked=ctx.acked,
            queued_ms=ctx.queued_ms,
            started=started,
        )

    def prefill(self, ctx: Context, params: PrefillParams) -> Prefill | EnginePrefill:
        """The prefill, ready for the scheduler to feed (on an engine: its request, sent)."""
        from worker.caching import Prefill

        def send_progress(progress: PrefillProgress) -> None:
            ctx.send_notification("prefill/progress", progress)

        model = self._loaded()
        if isinstance(model, EngineModel):
            return EnginePrefill.start(model, params, request_id=ctx.id, is_cancelled=ctx.cancelled.is_set)
        return Prefill(
            self._store(), model, params, prompt=ctx.prompt,
            request_id=ctx.id, is_cancelled=ctx.cancelled.is_set, send_progress=send_progress,
        )

    def cache_list(self, ctx: Context, params: NoParams) -> CacheListResult:
        caches = self._store().list()
        return CacheListResult(
            caches=caches, total_bytes=sum(c.bytes for c in caches), max_bytes=self._cache_max_bytes
        )

    def cache_info(self, ctx: Context, params: CacheRefParams) -> CacheInfo:
        return self._store().info(params.cache)

    def cache_delete(self, ctx: Context, params: CacheRefParams) -> CacheDeleteResult:
        return CacheDeleteResult(deleted=self._store().delete(params.cache))

    def models_list(self, ctx: Context, params: NoParams) -> ModelsListResult:
        own: list[str] = []
        for name in self._registry.names():  # the names a reference never shadows
            try:
                backend = self._registry.get(name)
            except RpcError:
                continue
            if isinstance(backend, LocalModelBackend):
                own += backend.own_model_names()
        return model_refs.list_models(self._places, own)

    def cancel(self, ctx: Context, params: CancelParams) -> CancelResult:
        return ctx.cancel(params.id)

    def shutdown(self, ctx: Context, params: NoParams) -> None:
        """Answers null once every earlier request has answered: the session did the rest when
        it received the request (its declaration's ends_session)."""

    def prepare_side_thread(self) -> None:
        """Before the loaded model's work on a thread other than the model thread."""
        if isinstance(self._model, SideThreadModel):
            self._model.prepare_side_thread()

    def _store(self) -> CacheStore:
        if self._cache_store is None:  # imported on first use: capabilities stays fast
            from worker.kvcache.store import CacheStore

            self._cache_store = CacheStore(self._cache_dir, self._cache_max_bytes, self._memory_cache_max_bytes)
        return self._cache_store

    def close(self) -> None:
        if self._model is not None:
            self._model.close()
            self._model = None
            heap.thaw(collect=False)

    def _loaded(self) -> Model:
        model = self._model
        if model is None:
            raise RpcError(
                ErrorKind.MODEL_NOT_LOADED,
                'No model is loaded; send "load" first, e.g. {"jsonrpc":"2.0","id":1,"method":"load",'
                '"params":{"backend":"echo"}}.',
            )
        return model

