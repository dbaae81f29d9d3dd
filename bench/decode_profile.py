"""Where a decode step's time goes, on SmolLM2-135M, for each way the worker can take a step.

    .venv/bin/python bench/decode_profile.py [--context 2000] [--steps 40]

For each path it prints the wall time of a step (median of --steps, after a prompt of
--context tokens) and, from torch's profiler, the time in operator kernels by kind:
matrix products of the weights, attention, copies of the cache, the native pass (a Llama
model's every layer in one call, which the profiler cannot split), every other operator;
what is left of the wall time is Python and the framework around the operators.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from protocol.methods import LoadParams  # noqa: E402
from worker.backends.transformers.backend import TransformersBackend  # noqa: E402
from worker.data_dir import default_data_dir  # noqa: E402

KINDS = {
    "weights": (
        "aten::mm", "aten::addmm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
        "lm_worker::int8_matmul", "lm_worker::gguf_matmul",
    ),
    "attention": (
        "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm", "aten::_softmax",
        "lm_worker::attention", "lm_worker::step_attention",
    ),
    "cache copies": ("aten::cat", "aten::copy_"),
    # native_forward's one call: every layer's products, attention, norms and activations
    "native pass": ("lm_worker::native_forward",),
}


def name_the_worker_kernels() -> None:
    """The worker's own C kernels are called through ctypes, which torch's profiler does not
    see: name each call (here only, for the profile) so that it counts as its kind."""
    from worker.backends.transformers.exact_attention import Kernel
    from worker.backends.transformers.fast_weights import Int8Linear
    from worker.backends.transformers.gguf_weights import GgufLinear
    from worker.backends.transformers.native_forward import NativeForward

    def named(owner: type, method: str, name: str) -> None:
        call = getattr(owner, method)

        def recorded(*args, **kwargs):
            with torch.profiler.record_function(name):
                return call(*args, **kwargs)

        setattr(owner, method, recorded)

    named(Int8Linear, "forward", "lm_worker::int8_matmul")
    named(GgufLinear, "forward", "lm_worker::gguf_matmul")
    named(Kernel, "attention", "lm_worker::attention")
    named(Kernel, "step_attention", "lm_worker::step_attention")
    named(NativeForward, "forward", "lm_worker::native_forward")
DENSE = {"dtype": "float32", "quantization": "none"}
PATHS = [
    ("transformers forward, dense float32 (the worker before)", DENSE, "forward"),
    ("transformers forward, int8 weights", {"quantization": "int8"}, "forward"),
    ("lm-worker step, dense float32", DENSE, "step"),
    ("lm-worker step, int8 weights, PyTorch's operations", {"quantization": "int8"}, "operations"),
    ("lm-worker step, int8 weights, native pass (the default)", {"quantization": "int8"}, "step"),
    ("lm-worker step, int4 weights", {"quantization": "int4"}, "step"),
]


def stepper(model, how: str):
    """One decode step of token 42 on a cache: the worker's own step (``operations``: decode_step's
    PyTorch operations where the model's step is the native pass), or transformers' forward."""
    from worker.backends.transformers.decode_step import DecodeStep

    if how == "forward":
        return lambda cache: cache.feed(model._model, torch.tensor([[42]]))
    step = DecodeStep(model._model) if how == "operations" else model._passes
    return lambda cache: step([42], [cache])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=16, help="prompt tokens before the measured steps")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    name_the_worker_kernels()
    print(f"SmolLM2-135M, {args.threads} threads, {args.context} positions cached; ms per decode step\n")
    print("| path | step (ms) | tokens/s | weights | attention | cache copies | native pass | other operators | Python and framework |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, params, how in PATHS:
        # through torch: its profiler times the torch paths (a second load of default otherwise goes without it)
        model = TransformersBackend().load_with_torch(LoadParams(model="default", **params), data_dir=default_data_dir())
        if how != "step" and type(model._model).__name__ == "ShellModel":
            print(f"| {label} | the kept int8 weights are computed by the native pass alone (int8_store.py) |", flush=True)
            model.close()
            continue
        step = stepper(model, how)
        with torch.inference_mode():
            cache = model.new_cache()
            model.extend_cache(list(range(100, 100 + args.context)), cache)
            for _ in range(3):
                step(cache)
            times = []
            for _ in range(args.steps):
                started = time.perf_counter()
                step(cache)
                times.append((time.perf_counter() - started) * 1000)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                for _ in range(10):
                    step(cache)
        wall = statistics.median(times)
        by_kind = dict.fromkeys([*KINDS, "other"], 0.0)
        for event in profile.key_averages():
            kind = next((k for k, names in KINDS.items() if event.key in names), "other")
            by_kind[kind] += event.self_cpu_time_total / 1000 / 10
        framework = max(wall - sum(by_kind.values()), 0.0)
        cells = [f"{by_kind[k]:.1f}" for k in (*KINDS, "other")]
        print(f"| {label} | {wall:.1f} | {1000 / wall:.0f} | {' | '.join(cells)} | {framework:.1f} |", flush=True)
        model.close()


if __name__ == "__main__":
    main()
