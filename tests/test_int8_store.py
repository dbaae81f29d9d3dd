"""A model directory's int8 weights made once and kept in the data directory (int8_store.py): later
loads map them into shell_model's modules, with the same numbers and the same cache identity; a
kept file that is damaged, hostile or in the way is never used, and the load makes it again."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from tests.test_transformers_backend import generate
from worker.host import Host

torch = pytest.importorskip("torch")

TEXT = "the quick brown fox jumps over the lazy dog"


def load(path: Path, data_dir: Path, **params):
    from protocol.methods import LoadParams
    from worker.backends.transformers.backend import TransformersBackend

    return TransformersBackend().load_with_torch(LoadParams(model=str(path), **params), data_dir=data_dir)


def logits_of(model) -> torch.Tensor:
    with torch.inference_mode():
        return torch.from_numpy(model.forward_chunk(model.new_cache(), model.tokenize(TEXT, add_special_tokens=True)))


def kept_file(data_dir: Path) -> Path:
    (found,) = (data_dir / "int8").glob("*.lmw8")
    return found


@pytest.fixture
def no_quantizing(monkeypatch: pytest.MonkeyPatch):
    """Makes any quantization at load an error: a load that maps the kept file quantizes nothing."""
    from worker.backends.transformers import fast_weights

    def refused(*args, **kwargs):
        raise AssertionError("the load quantized the weights again")

    def apply() -> None:
        monkeypatch.setattr(fast_weights, "quantize", refused)

    return apply


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_directory_s_int8_weights_are_made_once_and_later_loads_map_them_with_the_same_numbers(
    tiny_models, tmp_path: Path, family: str, no_quantizing
):
    first = load(tiny_models(family), tmp_path)
    assert type(first._model).__name__ != "ShellModel" and first.info.quantization == "int8"
    kept = kept_file(tmp_path)
    no_quantizing()
    second = load(tiny_models(family), tmp_path)
    assert type(second._model).__name__ == "ShellModel" and second.info.quantization == "int8"
    assert second.cache_identity() == first.cache_identity()
    assert torch.equal(logits_of(second), logits_of(first))
    assert second.eos_token_ids == first.eos_token_ids and second.info.context_length == first.info.context_length
    assert kept_file(tmp_path) == kept


def test_a_model_the_native_pass_does_not_compute_keeps_nothing(tiny_models, tmp_path: Path):
    load(tiny_models("qwen3_5"), tmp_path)
    assert not (tmp_path / "int8").exists() or not list((tmp_path / "int8").iterdir())


def test_dense_weights_keep_nothing(tiny_model_dir: Path, tmp_path: Path):
    load(tiny_model_dir, tmp_path, quantization="none")
    assert not (tmp_path / "int8").exists()


def rewrite_header(path: Path, change) -> None:
    """The kept file with its header changed by ``change`` (the data left as it is)."""
    data = path.read_bytes()
    length = struct.unpack_from("<Q", data, 8)[0]
    header = json.loads(data[16:16 + length])
    change(header)
    encoded = json.dumps(header).encode()
    prefix = data[:4] + struct.pack("<IQ", 1, len(encoded)) + encoded
    start = -(-(16 + length) // 64) * 64
    path.write_bytes(prefix + bytes(-len(prefix) % 64) + data[start:])


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def misshapen(header: dict) -> None:
    name = next(name for name in header["tensors"] if name.endswith("norm.weight"))
    header["tensors"][name][1] = [header["tensors"][name][1][0] // 2]


def other_key(header: dict) -> None:
    header["key"] = "0" * 64


def overlapping(header: dict) -> None:
    names = list(header["tensors"])
    header["tensors"][names[1]][2] = header["tensors"][names[0]][2]


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (flip_last_byte, "checksum does not match its bytes: damaged"),
        (lambda path: path.write_bytes(path.read_bytes()[:-64]), "out of its place"),
        (lambda path: path.write_bytes(path.read_bytes() + bytes(64)), "truncated or added to"),
        (lambda path: path.write_bytes(b"LMW8" + struct.pack("<IQ", 1, 1 << 40)), "header says 1099511627776 bytes"),
        (lambda path: path.write_bytes(b"GGUF" + bytes(60)), "not a file of int8 weights"),
        (lambda path: rewrite_header(path, misshapen), "misshapen"),
        (lambda path: rewrite_header(path, other_key), "not of"),
        (lambda path: rewrite_header(path, overlapping), "overlaps the tensor before it"),
        (lambda path: rewrite_header(path, lambda header: header.pop("crc32c")), "not one this worker writes"),
    ],
    ids=["bit-flip", "truncated", "added-to", "huge-header", "foreign", "misshapen", "other-key", "overlapping",
         "no-checksum"],
)
def test_a_damaged_or_hostile_kept_file_is_never_used_and_the_load_makes_it_again(
    tiny_model_dir: Path, tmp_path: Path, damage, says: str, caplog: pytest.LogCaptureFixture
):
    first = load(tiny_model_dir, tmp_path)
    kept = kept_file(tmp_path)
    damage(kept)
    again = load(tiny_model_dir, tmp_path)
    assert type(again._model).__name__ != "ShellModel"
    assert any(says in record.getMessage() for record in caplog.records), [r.getMessage() for r in caplog.records]
    assert torch.equal(logits_of(again), logits_of(first))
    mapped = load(tiny_model_dir, tmp_path)  # written again whole
    assert type(mapped._model).__name__ == "ShellModel"
    assert torch.equal(logits_of(mapped), logits_of(first))


def test_a_fifo_or_a_directory_in_the_kept_file_s_place_is_never_opened_and_the_load_goes_on(
    tiny_model_dir: Path, tmp_path: Path
):
    load(tiny_model_dir, tmp_path)
    kept = kept_file(tmp_path)
    kept.unlink()
    os.mkfifo(kept)
    replaced = load(tiny_model_dir, tmp_path)  # the FIFO is replaced by the file
    assert type(replaced._model).__name__ != "ShellModel" and kept.is_file()
    kept.unlink()
    kept.mkdir()
    (kept / "x").write_text("in the way")
    blocked = load(tiny_model_dir, tmp_path)
    assert type(blocked._model).__name__ != "ShellModel" and kept.is_dir()
    assert not [p for p in kept.parent.iterdir() if p.name.startswith(".")]  # no temporary left


def test_a_temporary_a_killed_writer_left_is_removed_by_the_next_writer_and_a_live_writer_s_is_not(
    tiny_model_dir: Path, tmp_path: Path
):
    import signal
    import subprocess
    import sys

    load(tiny_model_dir, tmp_path)
    kept = kept_file(tmp_path)
    kept.unlink()
    hold = (f"import sys, time; from pathlib import Path; from worker.kvcache.write import _locked_temporary; "
            f"_locked_temporary(Path({str(kept)!r})); print('held', flush=True); time.sleep(600)")
    killed, live = (subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True) for _ in range(2))
    try:
        for writer in (killed, live):
            assert writer.stdout is not None and writer.stdout.readline() == "held\n"
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        temporaries = lambda: sorted(p.name for p in kept.parent.iterdir() if p.name.startswith("."))  # noqa: E731
        left = temporaries()
        assert len(left) == 2
        load(tiny_model_dir, tmp_path)
        assert kept.is_file()
        (remaining,) = temporaries()
        assert remaining in left and f".{killed.pid}." not in remaining and f".{live.pid}." in remaining
    finally:
        live.kill()
        live.wait()


async def test_greedy_from_a_cache_made_before_the_weights_were_kept_equals_greedy_without_one_after(
    tiny_model_dir: Path, tmp_path: Path
):
    """A cache prefilled by the load that quantized the weights serves the loads that map them:
    one identity, one arithmetic."""
    args = ("--data-dir", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "caches"))
    prompt = " ".join(["the history of the city begins with a small settlement by the river."] * 3)
    first = await Host.start_in_process(*args)
    try:
        await first.call("load", {"model": str(tiny_model_dir)}, timeout=120)
        await first.call("prefill", {"prompt": prompt, "cache": "ctx"}, timeout=60)  # kept on disk
    finally:
        await first.close()
    assert kept_file(tmp_path / "data")
    second = await Host.start_in_process(*args)
    try:
        await second.call("load", {"model": str(tiny_model_dir)}, timeout=120)
        cached, _ = await generate(second, {"prompt": prompt + " And so", "max_tokens": 12, "temperature": 0, "cache": "ctx"})
        plain, _ = await generate(second, {"prompt": prompt + " And so", "max_tokens": 12, "temperature": 0})
        assert cached["tokens"] == plain["tokens"]
        assert cached["usage"]["cache_read_tokens"] > 0
    finally:
        await second.close()


async def test_two_worker_processes_one_after_the_other_quantize_once_and_answer_alike(tiny_model_dir: Path, tmp_path: Path):
    """Through `python -m worker` over its pipes: the first process's load quantizes and keeps the
    weights, the second's has no quantizing stage (it maps them), and both give the same greedy
    tokens."""
    from tests.conftest import TORCH_ENV

    env = {**os.environ, **TORCH_ENV, "LM_WORKER_DATA_DIR": str(tmp_path / "data")}
    stages, answers = [], []
    for _ in range(2):
        host = await Host.spawn(env=env)
        try:
            await host.call("load", {"model": str(tiny_model_dir), "progress": True}, timeout=180)
            stages.append({m["params"]["stage"] for m in host.messages if m.get("method") == "load/progress"})
            answer = await host.call("generate", {"prompt": TEXT, "max_tokens": 12, "temperature": 0}, timeout=60)
            answers.append(answer["tokens"])
        finally:
            await host.close()
    assert "quantizing" in stages[0] and "quantizing" not in stages[1], stages
    assert answers[0] == answers[1] and len(answers[0]) == 12
    assert kept_file(tmp_path / "data").stat().st_size > 0


def test_a_load_that_maps_kept_int8_weights_imports_none_of_transformers_heavy_modules(tiny_model_dir: Path, tmp_path: Path):
    """In a fresh process, as a worker's second load of a Llama directory (tests.conftest.HEAVY_MODULES
    says why none is needed)."""
    from tests.conftest import load_in_a_fresh_process

    load(tiny_model_dir, tmp_path)
    for note in (tmp_path / "int8").glob("*.note"):  # with it, the load imports neither torch nor transformers (test_int8_pass)
        note.unlink()
    assert load_in_a_fresh_process(tiny_model_dir, tmp_path) == "ShellModel []"


def resident_bytes_of_mapping(path: Path) -> int:
    """What of ``path``'s mapping in this process is resident (/proc/self/smaps' Rss)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line: range, perms, offset, dev, inode [path]
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_checking_a_kept_file_leaves_the_embedding_s_pages_out_of_the_process(tiny_model_dir: Path, tmp_path: Path):
    """The checksum reads every byte; the float32 embedding, which a decode reads a row a token,
    must not stay resident for it (it is the largest tensor of a small model's file)."""
    from worker.backends.transformers import int8_file
    from worker.kvcache import checksum

    load(tiny_model_dir, tmp_path)
    path = kept_file(tmp_path)
    key = json.loads(path.read_bytes()[16:16 + struct.unpack_from("<Q", path.read_bytes(), 8)[0]])["key"]
    checksum.load_kernel(tmp_path / "kernels")
    data, tensors = int8_file.read(path, key)
    embedding = tensors["model.embed_tokens.weight"]
    assert embedding.nbytes >= 16 * os.sysconf("SC_PAGE_SIZE")
    resident = resident_bytes_of_mapping(path)
    assert 0 < resident <= len(data) - embedding.nbytes + 2 * os.sysconf("SC_PAGE_SIZE"), (resident, len(data))
