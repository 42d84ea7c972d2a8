# Ranged loads (format 2): a loading rank reads from the rank files only the bytes it holds, under any saving and
# loading layout, and checks each block it reads. Unit level, in one process: tensors cut into TP shards (fused
# row sets along dim 0, column shards along dim 1, experts x TP) and ZeRO-1 pieces written as rank files, then
# read back into every kind of target and compared with the same selection of the full tensor; the bytes read
# are counted. Model level: a load names a flipped byte it reads, format-1 checkpoints (torch.save zips) still
# load, and a newer format is one line.
import json
import math
import os

import pytest
import torch

from runtime.checkpoint import Checkpointer, committed_checkpoints, full_tensors, load_checkpoint, open_storage
from runtime.checkpoint import read_rank_files
from runtime.checkpoint.integrity import DamagedCheckpoint, file_digest
from runtime.checkpoint.rankfile import RankFile, write_rank_file
from runtime.checkpoint.reshard import RangedSource, Target
from runtime.checkpoint.shards import rank_pieces
from runtime.checkpoint.storage import _LocalReader
from runtime.models import ModelConfig, build_model
from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model
from runtime.parallel.data_parallel import data_parallel_of

FULL = {"qkv": (12, 8), "proj": (8, 12), "experts": (4, 6, 5), "bias": (12,)}
# Rows of each TP rank along the sharded dim: a fused [q | k | v] row set, contiguous columns, experts' rows.
FUSED = [torch.tensor([0, 1, 4, 5, 8, 9]), torch.tensor([2, 3, 6, 7, 10, 11])]
HALVES = lambda n: [torch.arange(0, n // 2), torch.arange(n // 2, n)]  # noqa: E731
LAYOUTS = {  # name -> {tensor: (dim, [rows per TP rank]) or None for whole}
    "tp1": {name: None for name in FULL},
    "tp2": {"qkv": (0, FUSED), "proj": (1, HALVES(12)), "experts": (1, HALVES(6)), "bias": (0, FUSED)},
}


def _full() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in FULL.items()}


def _shards(name: str, full: torch.Tensor, layout: str, experts: torch.Tensor | None = None) -> list[dict]:
    """Geometry and values of each TP shard of `name` under `layout` (with `experts` selected first)."""
    base = full if experts is None else full.index_select(0, experts)
    spec = LAYOUTS[layout][name]
    cuts = [(None, None)] if spec is None else [(spec[0], rows) for rows in spec[1]]
    out = []
    for dim, rows in cuts:
        value = base if dim is None else base.index_select(dim, rows)
        geometry = {"dim": dim, "index": rows, "full_shape": tuple(full.shape), "shard_shape": tuple(value.shape)}
        if experts is not None:
            geometry["experts"] = experts
        out.append((geometry, value.contiguous()))
    return out


def _write(tmp_path, layout: str, zero1_files: int, full: dict) -> list[str]:
    """Rank files of `layout`: weights whole per TP shard in file 0; `exp_avg` of each shard cut into
    `zero1_files` flat pieces, one per file, as ZeRO-1 ranks save them. Returns the file names."""
    files = [{"model": {}, "optim": {}} for _ in range(zero1_files)]
    for name, tensor in full.items():
        groups = [None] if name != "experts" else [torch.tensor([0, 1]), torch.tensor([2, 3])]
        for experts in groups:
            for geometry, value in _shards(name, tensor, layout, experts):
                files[0]["model"].setdefault(name, []).append({**geometry, "start": 0, "value": value})
                flat = value.reshape(-1) * 10
                bounds = [round(i * flat.numel() / zero1_files) for i in range(zero1_files + 1)]
                for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
                    files[i]["optim"].setdefault(name, []).append(
                        {**geometry, "start": a, "exp_avg": flat[a:b].clone(), "exp_avg_sq": None, "master": None})
    names = []
    for i, pieces in enumerate(files):
        names.append(f"rank_{i:05d}.pt")
        write_rank_file(str(tmp_path / names[-1]), {"rank": i}, pieces)
    return names


class _Counting:
    """A storage whose readers count the bytes they read."""

    def __init__(self, storage):
        self.storage, self.read = storage, 0

    def reader(self, key):
        inner, outer = self.storage.reader(key), self

        class Reader:
            size = inner.size

            def read_into(self, offset, buffers):
                got = inner.read_into(offset, buffers)
                outer.read += got
                return got

            def close(self):
                inner.close()

        return Reader()


def _targets(layout: str) -> list[tuple[str, Target]]:
    out = []
    for name, shape in FULL.items():
        expert_groups = [None] if name != "experts" else [torch.tensor([0, 1]), torch.tensor([2, 3]),
                                                          torch.arange(4)]
        for experts in expert_groups:
            spec = LAYOUTS[layout][name]
            for rows in [None] if spec is None else spec[1]:
                selection = {} if experts is None else {0: experts}
                if rows is not None:
                    selection[spec[0]] = rows
                target_shape = list(shape)
                for dim, index in selection.items():
                    target_shape[dim] = index.numel()
                out.append((name, Target(tuple(target_shape), selection)))
    return out


@pytest.mark.parametrize("saved, loaded", [("tp1", "tp1"), ("tp2", "tp1"), ("tp1", "tp2"), ("tp2", "tp2")])
@pytest.mark.parametrize("verify", [True, False])
def test_every_target_gets_exactly_its_selection(tmp_path, saved, loaded, verify):
    full = _full()
    storage = _Counting(open_storage(tmp_path))
    files = [RankFile(storage, name) for name in _write(tmp_path, saved, zero1_files=3, full=full)]
    storage.read = 0
    source = RangedSource(files, verify=verify, workers=2)
    expected, outs = [], []
    for name, target in _targets(loaded):
        whole = target.take(full[name]).reshape(-1)
        numel = whole.numel()
        for lo, hi in [(0, numel), (1, numel - 2), (numel // 2, numel)]:  # whole, and ZeRO-1 shard ranges
            value, moment = torch.full((hi - lo,), float("nan")), torch.full((hi - lo,), float("nan"))
            source.fill(name, target, lo, hi, {"value": (value, "value"), "exp_avg": (moment, "exp_avg")})
            expected += [whole[lo:hi], whole[lo:hi] * 10]
            outs += [value, moment]
    source.run()
    source.close()
    for want, got in zip(expected, outs):
        assert torch.equal(want, got)


def test_a_rank_reads_only_its_share(tmp_path):
    """tp=1 checkpoint, tp=2 target along dim 0: half of the file's tensor bytes, not all of them."""
    full = {"qkv": torch.randn(4096, 64)}  # 1 MiB: several blocks
    write_rank_file(str(tmp_path / "rank_00000.pt"), {"rank": 0}, {"model": {"qkv": [
        {"dim": None, "index": None, "full_shape": (4096, 64), "shard_shape": (4096, 64), "start": 0,
         "value": full["qkv"]}]}, "optim": {}})
    storage = _Counting(open_storage(tmp_path))
    file = RankFile(storage, "rank_00000.pt")
    storage.read = 0
    source = RangedSource([file], verify=False, workers=2)
    out = torch.empty(2048 * 64)
    source.fill("qkv", Target((2048, 64), {0: torch.arange(2048, 4096)}), 0, out.numel(), {"v": (out, "value")})
    source.run()
    assert torch.equal(out, full["qkv"][2048:].reshape(-1))
    assert storage.read == out.numel() * 4


def _write_column_shards(tmp_path) -> torch.Tensor:
    full = torch.randn(16384, 256, generator=torch.Generator().manual_seed(1))
    write_rank_file(str(tmp_path / "rank_00000.pt"), {"rank": 0}, {"model": {"w": [
        {"dim": 1, "index": rows, "full_shape": (16384, 256), "shard_shape": (16384, 128), "start": 0,
         "value": full.index_select(1, rows).contiguous()} for rows in HALVES(256)]}, "optim": {}})
    return full


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("reader", ["mapped", "read"])
def test_column_shards_spanning_many_blocks(tmp_path, monkeypatch, verify, reader):
    """tp=2 along dim 1 of a 16 MiB matrix (8 MiB shards, 512-byte rows) into tp=1 and tp=4 targets and ZeRO-1
    ranges of them: the scattered path, chunk by chunk, each chunk's blocks checked; from a mapping of the local
    file, and read into a buffer where the reader cannot map (S3's)."""
    full = _write_column_shards(tmp_path)
    maps = []
    unwrapped = _LocalReader.map
    monkeypatch.setattr(_LocalReader, "map", lambda self, *a: maps.append(a) or unwrapped(self, *a))
    storage = open_storage(tmp_path) if reader == "mapped" else _Counting(open_storage(tmp_path))
    source = RangedSource([RankFile(storage, "rank_00000.pt")], verify=verify, workers=2)
    targets = [Target((16384, 256), {}), Target((16384, 64), {1: torch.arange(96, 160)})]
    expected, outs = [], []
    for target in targets:
        whole = target.take(full).reshape(-1)
        for lo, hi in [(0, whole.numel()), (whole.numel() // 3 + 1, whole.numel() // 2 + 3)]:
            out = torch.full((hi - lo,), float("nan"))
            source.fill("w", target, lo, hi, {"value": (out, "value")})
            expected.append(whole[lo:hi])
            outs.append(out)
    source.run()
    for want, got in zip(expected, outs):
        assert torch.equal(want, got)
    assert bool(maps) == (reader == "mapped")
    path = tmp_path / "rank_00000.pt"
    data = bytearray(path.read_bytes())
    data[12 << 20] ^= 1  # in the second shard's second MiB
    path.write_bytes(bytes(data))
    source = RangedSource([RankFile(storage, "rank_00000.pt")], verify=True, workers=2)
    source.fill("w", targets[0], 0, full.numel(), {"value": (torch.empty(full.numel()), "value")})
    with pytest.raises(ValueError, match=r"rank_00000.pt does not match its crc32 checksum at bytes 12582912-"):
        source.run()


def test_a_rank_file_cut_short_after_its_index_was_read_is_named(tmp_path):
    """The scattered path maps the file where it can: a file that has since lost the bytes is not mapped (which
    would kill the process with SIGBUS on the first missing page) but read, and named truncated."""
    full = _write_column_shards(tmp_path)
    source = RangedSource([RankFile(open_storage(tmp_path), "rank_00000.pt")], verify=True, workers=2)
    source.fill("w", Target((16384, 256), {}), 0, full.numel(), {"value": (torch.empty(full.numel()), "value")})
    os.truncate(tmp_path / "rank_00000.pt", 12 << 20)
    with pytest.raises(ValueError, match=r"rank_00000.pt ends at byte 12582912, before byte \d+ \(truncated\)"):
        source.run()


def test_missing_pieces_are_named(tmp_path):
    full = _full()
    names = _write(tmp_path, "tp2", zero1_files=2, full=full)
    files = [RankFile(open_storage(tmp_path), names[0])]  # the other ZeRO-1 rank's file is not there
    source = RangedSource(files, verify=True, workers=2)
    target = Target(FULL["qkv"], {})
    with pytest.raises(ValueError, match="checkpoint is incomplete"):
        source.fill("qkv", target, 0, math.prod(FULL["qkv"]), {"m": (torch.empty(96), "exp_avg")})


# ---- model level ---------------------------------------------------------------------------------------------

def _model(seed: int):
    torch.manual_seed(seed)
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))
    cfg = ModelConfig(architecture="gpt", vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4,
                      ffn_hidden_size=128, max_position_embeddings=32)
    model = parallelize_model(build_model(cfg), topo, data_parallel=DataParallelConfig())
    optimizer = ShardedAdamW(model, {"lr": 1e-3})
    for moment in optimizer.exp_avg:
        moment.uniform_()
    return topo, model, optimizer


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_load_checks_the_blocks_it_reads(tmp_path):
    topo, model, optimizer = _model(1)
    Checkpointer(str(tmp_path), rank=0, world_size=1, token="0", async_save=False).save(
        1, model, optimizer, topo, extra={"step": 1}, config={})
    storage = open_storage(tmp_path)
    [checkpoint] = committed_checkpoints(storage)
    topo, fresh, fresh_optimizer = _model(2)
    load_checkpoint(storage, checkpoint, fresh, fresh_optimizer, topo, rank=0)
    assert all(torch.equal(a, b) for a, b in zip(_params(model).values(), _params(fresh).values()))
    assert all(torch.equal(a, b) for a, b in zip(optimizer.exp_avg, fresh_optimizer.exp_avg))
    path = tmp_path / checkpoint.name / "rank_00000.pt"
    data = bytearray(path.read_bytes())
    data[100] ^= 0x10  # inside the first tensor
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint, match=rf"{checkpoint.name} is damaged: rank_00000.pt does not match its "
                                                 rf"crc32 checksum at bytes 0-"):
        load_checkpoint(storage, checkpoint, fresh, fresh_optimizer, topo, rank=0)


def _write_format_1(directory, model, optimizer, topo, step: int) -> None:
    """A checkpoint as nxdt wrote them before format 2: a torch.save zip per rank, whole-file sha256."""
    name = f"step_{step:08d}.0"
    (directory / name).mkdir(parents=True)
    model_pieces, optim_pieces = rank_pieces(data_parallel_of(model), optimizer, topo)
    layout = {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "zero1": False}
    torch.save({"format": 1, "rank": 0, "world_size": 1, "step": step, "layout": layout,
                "optim_scalars": {"step": 7, "sr_generator": None}, "extra": {"step": step},
                "model": model_pieces, "optim": optim_pieces}, directory / name / "rank_00000.pt")
    digest = file_digest(str(directory / name / "rank_00000.pt"))
    (directory / name / "COMMIT").write_text(json.dumps({"format": 1, "step": step, "world_size": 1,
                                                         "layout": layout, "files": {"rank_00000.pt": digest}}))


def test_a_format_1_checkpoint_still_loads(tmp_path):
    topo, model, optimizer = _model(1)
    _write_format_1(tmp_path, model, optimizer, topo, step=3)
    storage = open_storage(tmp_path)
    [checkpoint] = committed_checkpoints(storage)
    topo, fresh, fresh_optimizer = _model(2)
    info = load_checkpoint(storage, checkpoint, fresh, fresh_optimizer, topo, rank=0)
    assert info["extra"] == {"step": 3} and fresh_optimizer.step_count == 7
    assert all(torch.equal(a, b) for a, b in zip(_params(model).values(), _params(fresh).values()))
    assert all(torch.equal(a, b) for a, b in zip(optimizer.exp_avg, fresh_optimizer.exp_avg))
    full = full_tensors(read_rank_files(storage, checkpoint))
    assert torch.equal(full.get("layers.0.mlp.fc1.weight", "value"), _params(model)["layers.0.mlp.fc1.weight"])


def test_a_newer_format_is_one_line(tmp_path):
    topo, model, optimizer = _model(1)
    Checkpointer(str(tmp_path), rank=0, world_size=1, token="0", async_save=False).save(
        1, model, optimizer, topo, extra={"step": 1}, config={})
    commit = next(tmp_path.glob("step_*")) / "COMMIT"
    commit.write_text(json.dumps({**json.loads(commit.read_text()), "format": 3}))
    storage = open_storage(tmp_path)
    [checkpoint] = committed_checkpoints(storage)
    with pytest.raises(ValueError, match=r"is in format 3, newer than this nxdt reads \(formats 1 to 2\)"):
        load_checkpoint(storage, checkpoint, model, optimizer, topo, rank=0)


def test_block_checksums_are_zlibs_crc32_from_isal():
    """The runtime extra's ISA-L CRC-32 is what rank files use, and it is zlib's: files written before (and by a
    runtime without isal) check the same."""
    import zlib

    from isal import isal_zlib

    from runtime.checkpoint import rankfile
    assert rankfile.crc32 is isal_zlib.crc32
    data = torch.randint(0, 256, (3 * rankfile.BLOCK + 17,), dtype=torch.uint8).numpy().tobytes()
    assert rankfile.block_crcs(memoryview(data)) == [zlib.crc32(data[i:i + rankfile.BLOCK])
                                                     for i in range(0, len(data), rankfile.BLOCK)]
    assert rankfile.crc32(data[100:], rankfile.crc32(data[:100])) == zlib.crc32(data)  # chained, as loads check
