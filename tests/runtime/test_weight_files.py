"""Checkpoint files read by name without the rest (one process): every format, a shard reopened every READ_BYTES, and
errors that say what the path is."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import dapple.runtime.weight_files as wf

SD = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.weight": torch.ones(4), "c.bias": torch.zeros(3, 2)}


def _read(ckpt: wf.Checkpoint, keys: list[str]) -> tuple[dict[str, torch.Tensor], list[str], int]:
    dest = {k: torch.full_like(SD[k], -1.0) for k in keys}
    files, nbytes = ckpt.read(dest, {k: ckpt.where[k] for k in keys})
    return dest, files, nbytes


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in this one process
@pytest.mark.parametrize("kind", ["safetensors", "index", "torch", "bin", "dcp"])
def test_each_format_reads_the_tensors_asked_for(tmp_path, kind):
    if kind == "safetensors":
        save_file(SD, str(tmp_path / "m.safetensors"))
        path = tmp_path / "m.safetensors"
    elif kind == "index":
        save_file({"a.weight": SD["a.weight"]}, str(tmp_path / "s1.safetensors"))
        save_file({k: SD[k] for k in ("b.weight", "c.bias")}, str(tmp_path / "s2.safetensors"))
        weight_map = {"a.weight": "s1.safetensors", "b.weight": "s2.safetensors", "c.bias": "s2.safetensors"}
        (tmp_path / wf.SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
        path = tmp_path
    elif kind == "torch":
        torch.save(SD, tmp_path / "m.pt")
        path = tmp_path / "m.pt"
    elif kind == "bin":
        torch.save(SD, tmp_path / wf.TORCH_BIN)
        path = tmp_path
    else:
        dcp.save(SD, checkpoint_id=tmp_path, no_dist=True)
        path = tmp_path
    ckpt = wf.open_checkpoint(path)
    assert set(ckpt.where) == set(SD)
    assert ckpt.shapes({k: ckpt.where[k] for k in SD}) == {k: tuple(v.shape) for k, v in SD.items()}
    dest, files, nbytes = _read(ckpt, ["a.weight", "b.weight"])
    assert all(torch.equal(dest[k], SD[k]) for k in dest) and nbytes == 6 * 4 + 4 * 4
    if kind == "index":
        _, files, _ = _read(ckpt, ["a.weight"])
        assert [f.rsplit("/", 1)[-1] for f in files] == ["s1.safetensors"]  # the other shard stays shut


def test_a_shard_is_reopened_every_read_bytes(tmp_path, monkeypatch):
    save_file(SD, str(tmp_path / "m.safetensors"))
    opened = []
    real = wf.safe_open
    monkeypatch.setattr(wf, "safe_open", lambda f, *a, **k: (opened.append(f), real(f, *a, **k))[1])
    monkeypatch.setattr(wf, "READ_BYTES", 20)  # a.weight (24 bytes) alone, then b.weight and c.bias (16 + 24)
    ckpt = wf.open_checkpoint(tmp_path / "m.safetensors")
    opened.clear()
    dest, _, _ = _read(ckpt, list(SD))
    assert len(opened) == 3 and all(torch.equal(dest[k], SD[k]) for k in SD)


def test_paths_that_hold_no_checkpoint_say_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        wf.open_checkpoint(tmp_path / "nothing")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint .*\['notes.txt'\]"):
        wf.open_checkpoint(tmp_path)
    torch.save({"model": SD, "step": 3}, tmp_path / "train.pt")
    with pytest.raises(ValueError, match=r"holds a dict with keys \['model', 'step'\], not a state dict"):
        wf.open_checkpoint(tmp_path / "train.pt")
    with pytest.raises(ValueError, match="neither a .safetensors file nor a torch.save file"):
        wf.open_checkpoint(tmp_path / "notes.txt")
    (tmp_path / wf.SAFETENSORS_INDEX).write_text("{}")
    with pytest.raises(ValueError, match="is not a checkpoint index"):
        wf.open_checkpoint(tmp_path)
