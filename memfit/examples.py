"""Real models for the demo, the tests and the benchmarks, built from configs (no downloads).

Each builder returns an ``Example``: the model, ``loss_fn(model, *inputs)`` and
``make_inputs(batch_size)``. Sizes default to ones where saved activations are most of the
unplanned peak, which is the regime memfit is for, while staying quick on a 2-core CPU.
transformers and MONAI are optional dependencies (``pip install memfit[models]``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.data.hardware import Hardware
from memfit.data.units import Budget
from memfit.render.summary import Planned


@dataclass
class Example:
    """A model, its loss function and a way to make inputs for a batch size."""

    name: str
    model: nn.Module
    loss_fn: Callable
    make_inputs: Callable[[int], tuple[torch.Tensor, ...]]
    batch_size: int

    def inputs(self, batch_size: int | None = None) -> tuple[torch.Tensor, ...]:
        return self.make_inputs(batch_size or self.batch_size)


def _require(package: str) -> None:
    """Fail with what to install when an optional model library is missing."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ModuleNotFoundError(
            f"this example needs {package}, an optional dependency of memfit: "
            f"pip install 'memfit[models]' (or pip install {package})", name=package)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mlp(depth: int = 16, width: int = 256, batch_size: int = 2048, seed: int = 0) -> Example:
    """A deep ReLU MLP regressing random targets: the chain of the checkpointing literature."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))

    def loss_fn(model, x, y):
        return nn.functional.mse_loss(model(x), y)

    def make_inputs(batch):
        generator = _generator(seed + batch)
        return (torch.randn(batch, width, generator=generator),
                torch.randn(batch, 1, generator=generator))

    return Example("mlp", model, loss_fn, make_inputs, batch_size)


def gpt2(layers: int = 4, width: int = 64, heads: int = 4, vocab: int = 128, sequence: int = 128,
         batch_size: int = 4, dropout: float = 0.1, seed: int = 0) -> Example:
    """transformers ``GPT2LMHeadModel`` from a config (random init), language-model loss."""
    _require("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                        n_positions=sequence, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # otherwise a warning on every call breaks tracing
    return _causal_lm("gpt2", model, vocab, sequence, batch_size, seed)


def _causal_lm(name: str, model: nn.Module, vocab: int, sequence: int, batch_size: int,
               seed: int) -> Example:
    """A transformers causal language model on random tokens, its labels the tokens."""

    def loss_fn(model, input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    def make_inputs(batch):
        generator = _generator(seed + batch)
        ids = torch.randint(0, vocab, (batch, sequence), generator=generator)
        return ids, ids.clone()

    return Example(name, model, loss_fn, make_inputs, batch_size)


def resnet50_shaped(widths: tuple[int, ...] = (32, 64, 128, 256), image: int = 64,
                    batch_size: int = 8, classes: int = 10, seed: int = 0) -> Example:
    """transformers ``ResNetForImageClassification`` with ResNet-50's depths and shrunk widths.

    ``widths`` are the stage outputs (ResNet-50: 256, 512, 1024, 2048 after a 64-channel stem);
    the stem keeps ResNet-50's proportion, a quarter of the first stage. BatchNorm runs in
    training mode, so the step also updates running statistics (buffers). The config names its
    ``problem_type``, as ``bert``'s does: otherwise the first forward sets it, and
    ``torch.compile`` traces (and memfit plans) the model a second time on the second call.
    """
    _require("transformers")
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    config = ResNetConfig(num_channels=3, embedding_size=max(widths[0] // 4, 1),
                          hidden_sizes=list(widths),
                          depths=[3, 4, 6, 3], layer_type="bottleneck", num_labels=classes,
                          problem_type="single_label_classification")
    return _image_classifier("resnet50", ResNetForImageClassification(config), image, classes,
                             batch_size, seed)


def unet3d(channels: tuple[int, ...] = (4, 8, 16, 32), size: int = 32, batch_size: int = 2,
           seed: int = 0) -> Example:
    """MONAI's 3D ``UNet`` (residual units, instance norm) on random volumes, Dice-free MSE."""
    _require("monai")
    from monai.networks.nets import UNet

    torch.manual_seed(seed)
    model = UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=channels,
                 strides=(2,) * (len(channels) - 1), num_res_units=2)

    def loss_fn(model, volume, target):
        return nn.functional.mse_loss(model(volume), target)

    def make_inputs(batch):
        generator = _generator(seed + batch)
        return (torch.randn(batch, 1, size, size, size, generator=generator),
                torch.randn(batch, 2, size, size, size, generator=generator))

    return Example("unet3d", model, loss_fn, make_inputs, batch_size)


def t5(layers: int = 2, width: int = 64, heads: int = 4, vocab: int = 64, sequence: int = 32,
       batch_size: int = 4, dropout: float = 0.0, seed: int = 0) -> Example:
    """transformers ``T5ForConditionalGeneration`` from a config (random init), seq2seq loss.

    T5 builds its decoder inputs by shifting the labels right into a slice of a zeroed buffer:
    the captured ``aten.copy`` keeps that slice's gapped strides, a storage no node covers.
    """
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=vocab, d_model=width, d_kv=width // heads, d_ff=2 * width,
                      num_layers=layers, num_decoder_layers=layers, num_heads=heads,
                      dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config)

    def loss_fn(model, input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss

    def make_inputs(batch):
        generator = _generator(seed + batch)
        ids = torch.randint(1, vocab, (batch, sequence), generator=generator)
        return ids, ids.flip(1).contiguous()

    return Example("t5", model, loss_fn, make_inputs, batch_size)


def bert(layers: int = 2, width: int = 64, heads: int = 2, vocab: int = 128, sequence: int = 64,
         batch_size: int = 8, dropout: float = 0.0, seed: int = 0) -> Example:
    """transformers ``BertForSequenceClassification`` from a config, with a padded attention mask:
    every other row ends in a quarter of padding, so the mask changes the loss.

    The config names its ``problem_type``: otherwise the model's first forward sets it, and
    ``torch.compile`` sees a changed config on the second call and traces (and plans) again.
    """
    _require("transformers")
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=2 * width,
                        max_position_embeddings=sequence, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, attn_implementation="eager",
                        problem_type="single_label_classification")
    model = BertForSequenceClassification(config)

    def loss_fn(model, input_ids, attention_mask, labels):
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    def make_inputs(batch):
        generator = _generator(seed + batch)
        ids = torch.randint(0, vocab, (batch, sequence), generator=generator)
        mask = torch.ones(batch, sequence, dtype=torch.long)
        mask[::2, sequence - sequence // 4:] = 0
        return ids, mask, torch.randint(0, 2, (batch,), generator=generator)

    return Example("bert", model, loss_fn, make_inputs, batch_size)


def llama(layers: int = 2, width: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 128,
          sequence: int = 64, batch_size: int = 4, seed: int = 0) -> Example:
    """transformers ``LlamaForCausalLM`` from a config (grouped-query attention, rotary
    positions, RMSNorm, SwiGLU), language-model loss."""
    _require("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=sequence,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _causal_lm("llama", LlamaForCausalLM(config), vocab, sequence, batch_size, seed)


def vit(layers: int = 2, width: int = 64, heads: int = 4, image: int = 32, patch: int = 4,
        batch_size: int = 8, classes: int = 10, dropout: float = 0.0, seed: int = 0) -> Example:
    """transformers ``ViTForImageClassification`` from a config, cross-entropy on random labels."""
    _require("transformers")
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                       intermediate_size=2 * width, image_size=image, patch_size=patch,
                       num_labels=classes, hidden_dropout_prob=dropout,
                       attention_probs_dropout_prob=dropout,
                       problem_type="single_label_classification")  # as resnet50_shaped's
    return _image_classifier("vit", ViTForImageClassification(config), image, classes,
                             batch_size, seed)


def _image_classifier(name: str, model: nn.Module, image: int, classes: int, batch_size: int,
                      seed: int) -> Example:
    """A transformers image classifier on random RGB images and labels."""

    def loss_fn(model, pixels, labels):
        return model(pixel_values=pixels, labels=labels).loss

    def make_inputs(batch):
        generator = _generator(seed + batch)
        return (torch.randn(batch, 3, image, image, generator=generator),
                torch.randint(0, classes, (batch,), generator=generator))

    return Example(name, model, loss_fn, make_inputs, batch_size)


def cnn(channels: int = 16, blocks: int = 3, image: int = 32, batch_size: int = 8,
        classes: int = 10, seed: int = 0) -> Example:
    """A plain CNN of convolution, BatchNorm (training mode: running statistics are updated, a
    buffer mutation) and in-place ReLU blocks, then pooling and a linear classifier."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = 3
    for _ in range(blocks):
        layers += [nn.Conv2d(width, channels, 3, padding=1, bias=False),
                   nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]
        width = channels
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(channels, classes))

    def loss_fn(model, pixels, labels):
        return nn.functional.cross_entropy(model(pixels), labels)

    def make_inputs(batch):
        generator = _generator(seed + batch)
        return (torch.randn(batch, 3, image, image, generator=generator),
                torch.randint(0, classes, (batch,), generator=generator))

    return Example("cnn", model, loss_fn, make_inputs, batch_size)


class _LSTMTagger(nn.Module):
    """Embedding, a multi-layer ``nn.LSTM`` and a per-token classifier."""

    def __init__(self, vocab: int, width: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=layers, batch_first=True, dropout=dropout)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embedding(tokens))
        return self.head(hidden)


def lstm(layers: int = 2, width: int = 64, vocab: int = 64, sequence: int = 16,
         batch_size: int = 8, dropout: float = 0.0, seed: int = 0) -> Example:
    """A token tagger around ``nn.LSTM`` (CPU: the fused mkldnn RNN op, several outputs),
    cross-entropy per token."""
    torch.manual_seed(seed)
    model = _LSTMTagger(vocab, width, layers, dropout)

    def loss_fn(model, tokens, labels):
        return nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())

    def make_inputs(batch):
        generator = _generator(seed + batch)
        tokens = torch.randint(0, vocab, (batch, sequence), generator=generator)
        return tokens, tokens.roll(1, dims=1)

    return Example("lstm", model, loss_fn, make_inputs, batch_size)


class _SwinStage(nn.Module):
    """A pair of MONAI ``SwinTransformerBlock``s, plain then shifted windows, whose mask is built
    inside the stage by MONAI's ``compute_mask`` (slice assignments: ``slice_scatter`` into
    slices), as MONAI's ``BasicLayer`` does; ``BasicLayer`` itself needs einops."""

    def __init__(self, width: int, heads: int, window: int) -> None:
        super().__init__()
        from monai.networks.nets.swin_unetr import SwinTransformerBlock

        self.window = (window,) * 3
        self.shift = (window // 2,) * 3
        self.blocks = nn.ModuleList(
            SwinTransformerBlock(dim=width, num_heads=heads, window_size=self.window,
                                 shift_size=shift) for shift in ((0, 0, 0), self.shift))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, depth, height, width, c)
        from monai.networks.nets.swin_unetr import compute_mask

        mask = compute_mask(list(x.shape[1:4]), self.window, self.shift, x.device)
        for block in self.blocks:
            x = block(x, mask)
        return x


def swin_blocks(stages: int = 2, width: int = 32, heads: int = 4, window: int = 4, size: int = 8,
                batch_size: int = 2, seed: int = 0) -> Example:
    """SwinUNETR-like 3D window attention: ``stages`` stages of MONAI Swin blocks, MSE loss."""
    torch.manual_seed(seed)
    model = nn.Sequential(*(_SwinStage(width, heads, window) for _ in range(stages)))

    def loss_fn(model, volume, target):
        return nn.functional.mse_loss(model(volume), target)

    def make_inputs(batch):
        generator = _generator(seed + batch)
        shape = (batch, size, size, size, width)
        return (torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator))

    return Example("swin", model, loss_fn, make_inputs, batch_size)


EXAMPLES: dict[str, Callable[..., Example]] = {
    "mlp": mlp,
    "gpt2": gpt2,
    "resnet50": resnet50_shaped,
    "unet3d": unet3d,
    "t5": t5,
    "swin": swin_blocks,
    "bert": bert,
    "llama": llama,
    "vit": vit,
    "cnn": cnn,
    "lstm": lstm,
}


def plan_example(model: str, batch_size: int | None, model_args: Mapping[str, Any],
                 budget: str | Budget | None, hardware: str | Hardware, strategy: str | None,
                 params: Mapping[str, Any], autocast: str | None = None, world_size: int = 1,
                 sharding: str = "none") -> Planned:
    """Build ``examples.<model>``, capture its step and plan it for ``hardware``, under the
    target's autocast (``"bf16"``, ``"fp16"``, ``None``; ``memfit.plan``'s ``autocast=``), one
    rank of ``world_size`` under ``sharding``, as ``memfit.plan``.

    Note:
        The model is built on the CPU with random weights; its inputs are meta tensors, traced
        as fake ones the way ``memfit.compile`` would trace the step (``memfit.fitting.traced``), so no
        step runs.

    Raises:
        ValueError: unknown model argument, strategy, parameter or hardware; a bad budget.
        BudgetError: if the strategy cannot reach the budget.
    """
    from memfit.data.hardware import get_hardware
    from memfit.fitting.cluster import resolve_sharding
    from memfit.fitting.traced import trace_plan
    from memfit.planning.strategies import resolve_budget_and_strategy

    parsed, chosen = resolve_budget_and_strategy(budget, strategy, params)
    profile = get_hardware(hardware)
    try:
        example = EXAMPLES[model](**model_args)
    except TypeError as error:
        raise ValueError(f"bad --model-arg for {model}: {error}") from None
    batch = batch_size or example.batch_size
    inputs = tuple(t.to("meta") for t in example.inputs(batch))  # shapes only: nothing runs
    spread = resolve_sharding(example.model, sharding, world_size)
    planned = trace_plan(example.model, example.loss_fn, inputs, parsed, chosen, profile, params,
                         what_ifs=True, autocast=autocast_dtype(autocast), sharding=spread)
    return Planned(model, batch, planned.graph, planned.plan, planned.baseline, planned.predicted,
                   planned.budget.device_bytes)


def autocast_dtype(name: str | None) -> Any:
    """The torch dtype of a command line's ``--autocast`` (``"bf16"``, ``"fp16"``), or ``None``."""
    return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
