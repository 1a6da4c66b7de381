"""Tiny models as users have them: transformers' GPT-2, BERT and Llama from configs (no download), a CNN with
BatchNorm; their losses on the model's own output, and batches."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64


def causal_lm_loss(out: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on ``out.logits`` (B, T, V): position t predicts token t + 1."""
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def classifier_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, labels)


def gpt2() -> nn.Module:
    import transformers
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def bert() -> nn.Module:
    """Dropout as configured by default (0.1): trained and evaluated in eval mode, where it is off."""
    import transformers
    cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                  vocab_size=VOCAB, max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def llama() -> nn.Module:
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def t5() -> nn.Module:
    """Its relative position bias (1, heads, T, T), made in encoder.block.0 from a parameter, is read by
    encoder.block.1: a cut between them sends it whole."""
    import transformers
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=1,
                                num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def bloom() -> nn.Module:
    """forward(input_ids, past_key_values, attention_mask, ...): a padding mask can only be given by name."""
    import transformers
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=2, hidden_dropout=0.0,
                                   attention_dropout=0.0)
    return transformers.BloomForCausalLM(cfg)


def seq2seq_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the decoder's logits (B, T, V) against labels (B, T)."""
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def padded_lm_loss(out: Any, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on ``out.logits`` over each row's unpadded positions (mask 1), averaged over the
    rows: the mean over the rows given, as a pipeline's loss must be (a mean over all unpadded tokens would weigh
    a slice's rows by its own token count)."""
    keep = mask[:, 1:].to(out.logits.dtype)  # (B, T - 1)
    per_token = F.cross_entropy(out.logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")  # (B, T - 1)
    return ((per_token * keep).sum(1) / keep.sum(1)).mean()


def by_name(rows: int, length: int, gen: torch.Generator, decoder: bool = False
            ) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """Inputs by name: token ids and an attention mask whose odd rows end in padding (and decoder ids); targets:
    the decoder ids, or the ids and the mask."""
    ids = torch.randint(0, VOCAB, (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1::2, length - 2:] = 0
    if decoder:
        dec = torch.randint(0, VOCAB, (rows, length - 2), generator=gen)
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}, (dec,)
    return {"input_ids": ids, "attention_mask": mask}, (ids, mask)


class ConvBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> same
        return torch.relu(x + self.bn(self.conv(x)))


class ConvNet(nn.Module):
    """Layers: stem.0-2, blocks.0-1, head.0-2. In training, BatchNorm normalises by the statistics of the rows it
    is given: pipelined, a slice of a micro-batch; :func:`sliced_convnet` runs the same slices in one process."""

    def __init__(self, c: int = 4, classes: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(ConvBlock(c), ConvBlock(c))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def sliced_convnet(model: ConvNet, x: torch.Tensor) -> torch.Tensor:
    """The ConvNet run as its pipeline (stages stem | blocks on 2 replicas | head, micro-batches of 4) runs it: the
    stem on each micro-batch, the blocks on each replica's 2 rows of it, the head on all rows."""
    h = torch.cat([model.stem(c) for c in x.split(4)])
    h = torch.cat([model.blocks(c) for c in h.split(2)])
    return model.head(h)


class Checked(nn.Module):
    """A block with a check on its values: torch.fx cannot trace the branch (its error says to make the block a
    leaf module) and the meta device cannot run it (shape inference runs it on the CPU)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(x).all():
            raise ValueError("non-finite activations")
        return torch.tanh(self.fc(x))


class CheckedNet(nn.Module):
    """(B, T, 6) -> (B, T, 3); layers embed, blocks.0-2, head."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList([Checked(8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def sequences(rows: int, length: int, gen: torch.Generator
              ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    return (torch.randn(rows, length, 6, generator=gen),), (torch.randint(0, 3, (rows, length), generator=gen),)


class Case(NamedTuple):
    """A model, its loss, a batch maker (rows, length, generator) -> (inputs, targets) and how it is run."""

    make: Callable[[], nn.Module]
    loss_fn: Callable[..., torch.Tensor]
    batch: Callable[[int, int, torch.Generator], tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]
    layers: tuple[str, ...]  # what the default rule makes of the model
    cuts: tuple[int, int]  # stage 0 is layers [0, a), stage 1 (two replicas) [a, b), stage 2 [b, end)
    train_mode: bool = True  # False: trained in eval mode (its dropout off), so single-process steps match
    tracer: str = "auto"
    sliced: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None  # the single-process training forward
    leaf_modules: tuple = ()


def tokens(rows: int, length: int, gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    ids = torch.randint(0, VOCAB, (rows, length), generator=gen)
    return (ids,), (ids,)


def masked_tokens(rows: int, length: int, gen: torch.Generator, classes: int | None = None
                  ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Token ids and an attention mask whose odd rows end in padding; targets: the ids, or class labels."""
    ids = torch.randint(0, VOCAB, (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1::2, length - 2:] = 0
    return (ids, mask), ((ids,) if classes is None else (torch.randint(0, classes, (rows,), generator=gen),))


def images(rows: int, size: int, gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    return (torch.randn(rows, 3, size, size, generator=gen),), (torch.randint(0, 3, (rows,), generator=gen),)


GPT2 = ("transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
        "transformer.ln_f", "lm_head")
BERT = ("bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "bert.pooler", "dropout", "classifier")
LLAMA = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head")  # no rotary_emb layer

CASES = {
    "gpt2": Case(gpt2, causal_lm_loss, tokens, GPT2, (4, 5)),  # wte wpe drop h.0 | h.1 | ln_f lm_head (tied to wte)
    "bert": Case(bert, classifier_loss, lambda r, t, g: masked_tokens(r, t, g, classes=3), BERT, (2, 3),
                 train_mode=False),  # embeddings layer.0 | layer.1 | pooler dropout classifier
    "llama": Case(llama, causal_lm_loss, masked_tokens, LLAMA, (2, 3)),  # embed_tokens layers.0 | layers.1 | ...
    "cnn": Case(ConvNet, lambda out, y: F.cross_entropy(out, y), images,
                ("stem.0", "stem.1", "stem.2", "blocks.0", "blocks.1", "head.0", "head.1", "head.2"), (3, 5),
                tracer="fx", sliced=sliced_convnet),  # stem.0-2 | blocks.0-1 | head.0-2
    "leaf": Case(CheckedNet, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), sequences,
                 ("embed", "blocks.0", "blocks.1", "blocks.2", "head"), (2, 3), tracer="fx",
                 leaf_modules=(Checked,)),  # embed blocks.0 | blocks.1 | blocks.2 head
}
