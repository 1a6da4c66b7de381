"""Per-rank work for test_meta_build: a GPT built on the meta device, each rank making only its stage real and loading
its weights from each kind of checkpoint, against single-process float64 training of the same weights."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import dapple
import dapple.runtime.weight_files as weight_files
from dapple.models import GPT, lm_loss, random_tokens
from dapple.planner import Plan, Stage
from dapple.profiler import trace_layers

KW = {"vocab_size": 32, "block_size": 16, "n_layer": 4, "n_head": 2, "n_embd": 8}
# layers: wte wpe drop blocks.0 | blocks.1 blocks.2 (2 replicas) | blocks.3 ln_f lm_head (tied to wte, stage 0)
STAGES = [((0, 4), [0]), ((4, 6), [1, 2]), ((6, 9), [3])]
GBS, MBS, SEQ = 8, 4, 8
SHARDS = {"a": ("wte", "wpe"), "b": ("blocks.0", "blocks.1"), "c": ("blocks.2",), "d": ("blocks.3", "ln_f")}


def full_model() -> GPT:
    torch.manual_seed(0)
    return GPT(**KW).double()


def meta_model() -> GPT:
    with torch.device("meta"):
        return GPT(**KW).double()


def plan() -> Plan:
    return Plan(GBS, MBS, [Stage(span, d) for span, d in STAGES], layer_names=trace_layers(meta_model()).names)


def write_checkpoints(root: Path) -> dict[str, str]:
    """The full model's weights as a sharded safetensors checkpoint (``lm_head.weight`` left out: tied, as
    transformers saves it), a torch.save state dict, and the same with one key missing and one shape changed."""
    sd = {k: v.contiguous() for k, v in full_model().state_dict().items() if k != "lm_head.weight"}
    sharded = root / "sharded"
    sharded.mkdir()
    weight_map = {}
    for shard, prefixes in SHARDS.items():
        keys = [k for k in sd if k.startswith(tuple(p + "." for p in prefixes))]
        save_file({k: sd[k] for k in keys}, str(sharded / f"{shard}.safetensors"))
        weight_map.update({k: f"{shard}.safetensors" for k in keys})
    assert set(weight_map) == set(sd)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    torch.save(full_model().state_dict(), root / "model.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save(full_model().state_dict(), checkpoint_id=root / "plain_dcp", no_dist=True)  # state_dict names
    bad = dict(sd)
    del bad["ln_f.weight"]  # stage 2's
    bad["blocks.1.attn.qkv.weight"] = torch.zeros(3, 3, dtype=torch.float64)  # stage 1's
    torch.save(bad, root / "bad.pt")
    return {"safetensors": str(sharded), "torch": str(root / "model.pt"), "bad": str(root / "bad.pt"),
            "dapple": str(root / "dapple"), "dcp": str(root / "plain_dcp")}


def reference() -> tuple[float, dict[str, torch.Tensor], tuple]:
    model = full_model()
    x, y = random_tokens(GBS, SEQ, KW["vocab_size"], torch.Generator().manual_seed(1))
    loss = lm_loss(model(x), y)
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}, (x, y)


class Opened:
    """Records the files ``safe_open`` opens and the keys read from them, on this rank."""

    def __init__(self):
        self.files: list[str] = []
        self.keys: list[str] = []
        self.real = weight_files.safe_open

    def __call__(self, file: str, *args: Any, **kwargs: Any) -> Any:
        self.files.append(Path(file).name)
        handle = self.real(file, *args, **kwargs)
        opened = self

        class Handle:
            def __enter__(self):
                self.f = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_slice(self, key):
                return self.f.get_slice(key)

            def get_tensor(self, key):
                opened.keys.append(key)
                return self.f.get_tensor(key)
        return Handle()


def _step(pipe: dapple.Pipeline, ref: tuple) -> dict[str, Any]:
    ref_loss, ref_grads, (x, y) = ref
    loss = pipe.train_step(x, y)
    grads = max(float((p.grad - ref_grads[n]).abs().max()) for n, p in pipe.named_parameters())
    return {"loss": abs(loss - ref_loss), "grads": grads}


def run(paths: dict[str, str]) -> dict[str, Any]:
    """Per checkpoint kind: a meta-built pipeline, its weights loaded, one step against the reference (the first
    one also saves a dapple checkpoint, the next kind); then the errors of a checkpoint lacking a key and holding a
    wrong shape."""
    ref = reference()
    out: dict[str, Any] = {}
    for kind in ("safetensors", "dapple", "torch", "dcp"):
        pipe = dapple.pipeline(meta_model(), plan(), lm_loss)
        out.setdefault("first", [float(p.detach().sum()) for p in pipe.parameters()])  # before loading
        out.setdefault("devices", sorted({str(t.device) for t in pipe.state_dict().values()}))
        opened = Opened()
        weight_files.safe_open = opened
        try:
            loaded = dapple.load_weights(pipe, paths[kind])
        finally:
            weight_files.safe_open = opened.real
        if kind == "safetensors":
            dapple.save_checkpoint(paths["dapple"], pipe)  # a meta-built pipeline saves as any other
        out[kind] = {**_step(pipe, ref), "files": sorted(set(opened.files)), "keys": sorted(opened.keys),
                     "loaded": (loaded.format, loaded.tensors, loaded.bytes, loaded.unexpected_keys)}
    out["own"] = sorted(pipe.state_dict())
    out["own_bytes"] = sum(p.numel() * p.element_size() for p in pipe.parameters())
    try:
        dapple.load_weights(pipe, paths["bad"])
        out["bad"] = None
    except ValueError as e:
        out["bad"] = str(e)
    dist.barrier()
    return out
