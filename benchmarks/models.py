"""Real models for bench.py: timm and HF transformers, built from config with
random weights (nothing is downloaded).

Each builder takes a device and returns (callable, example inputs), as
bench.py's own workloads do.  Inference models are in eval mode; the
training step returns a loss for bench.py to call ``backward()`` on, and
carries ``zero_grad``, which bench.py calls before each step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Built = tuple[Callable[..., Any], tuple[Any, ...]]


def _timm(name: str, batch: int, size: int) -> Callable[[str], Built]:
    def build(device: str) -> Built:
        import timm
        import torch

        model = timm.create_model(name, pretrained=False).to(device).eval()
        return model, (torch.randn(batch, 3, size, size, device=device),)

    return build


def _ids(device: str, batch: int, seq: int, vocab: int) -> Any:
    import torch

    return torch.randint(0, vocab, (batch, seq), device=device)


def _gpt2_config(layers: int, **overrides: Any) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=layers,
        n_embd=256,
        n_head=4,
        n_positions=512,
        use_cache=False,
        attn_implementation="sdpa",
        **overrides,
    )


def gpt2(device: str) -> Built:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(_gpt2_config(4)).to(device).eval()

    def logits(ids: Any) -> Any:
        return model(ids).logits

    return logits, (_ids(device, 2, 64, model.config.vocab_size),)


def gpt2_dynamic(device: str) -> Built:
    """The GPT-2 above; bench.py compiles it with dynamic=True."""
    return gpt2(device)


def gpt2_train_step(device: str) -> Built:
    """One layer, in train mode (its dropout on); the loss, for backward()."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(_gpt2_config(1)).to(device).train()

    def loss(ids: Any) -> Any:
        return model(ids, labels=ids).loss

    # What a training loop does before each step (optimizer.zero_grad()):
    # the gradients are the backward's outputs, not sums over steps.
    loss.zero_grad = lambda: model.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    return loss, (_ids(device, 2, 64, model.config.vocab_size),)


def bert(device: str) -> Built:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        attn_implementation="sdpa",
    )
    model = BertModel(config).to(device).eval()

    def hidden(ids: Any) -> Any:
        return model(ids).last_hidden_state

    return hidden, (_ids(device, 2, 128, config.vocab_size),)


def t5(device: str) -> Built:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        d_model=256,
        d_ff=1024,
        d_kv=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        use_cache=False,
    )
    model = T5ForConditionalGeneration(config).to(device).eval()

    def logits(ids: Any, decoder_ids: Any) -> Any:
        return model(input_ids=ids, decoder_input_ids=decoder_ids).logits

    return logits, (
        _ids(device, 2, 64, config.vocab_size),
        _ids(device, 2, 32, config.vocab_size),
    )


resnet18 = _timm("resnet18", batch=2, size=224)
vit_tiny = _timm("vit_tiny_patch16_224", batch=2, size=224)
mobilenetv3 = _timm("mobilenetv3_large_100", batch=2, size=224)
