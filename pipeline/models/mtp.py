"""The checkpoint's MTP head (multi-token prediction), run on mlx-lm's own layers.

Follows the public reference implementations (vLLM's and SGLang's Qwen3-Next MTP
modules): for position i, with the main model's final hidden state h_i (after its
final norm) and the embedding of the token at i + 1,

    x   = fc(concat(pre_fc_norm_embedding(embed(t[i+1])), pre_fc_norm_hidden(h_i)))
    x   = decoder_layer(x)          # one full-attention layer with its own sparse MoE,
                                    # its own KV cache over the positions it has seen
    out = norm(x);  logits = lm_head(out)   # predicts t[i+2]; embed / lm_head shared

and a second draft feeds `out` back as the hidden state with the first draft's
embedding. The layer is the main model's own full-attention class, so attention, RoPE
and the MoE (softmax top-k, shared expert, its gate) compute exactly as mlx-lm's.

Its routed experts are streamed from the container (`manifest.mtp_experts`) through a
pool of their own (pipeline/models/mtp_experts.py): the head loaded here is then its
dense part, without `layer.mlp.switch_mlp`. A container packed before that keeps them
in `mtp.safetensors`; they are then loaded with the head and held resident.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from pipeline.models.text_parts import TextParts
from qpack.mtp import MTP_FILE, SWITCH
from qpack.spec import QpackError


class MtpHead(nn.Module):
    def __init__(self, parts: TextParts) -> None:
        super().__init__()
        args = parts.args
        h, eps = args.hidden_size, args.rms_norm_eps
        fa = next(i for i, layer in enumerate(parts.layers) if not layer.is_linear)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        layer_class: Any = type(parts.layers[fa])  # mlx-lm's decoder layer (args, index)
        self.layer = layer_class(args, fa)  # a full-attention one
        self.norm = nn.RMSNorm(h, eps=eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: Any, last_only: bool = False) -> mx.array:
        """[1, T, H] embeddings of t[i+1] and hidden states h_i -> the head's normed output
        (mlx-lm's decoder layer, its ops spelled out). `last_only`: the last position's
        alone, [1, 1, H]. A draft reads only that one: the others' attention fills the
        head's KV cache, and their experts (a catch-up over a prompt: most of the head's,
        read and computed for nothing) are skipped."""
        h = self.attend(embeds, hidden, cache, last_only)
        return self.norm(h + self.layer.mlp(self.layer.post_attention_layernorm(h)))

    def attend(self, embeds: mx.array, hidden: mx.array, cache: Any, last_only: bool = False) -> mx.array:
        """The layer's residual stream after its attention (the KV cache extended), before
        its MoE: [1, T, H], or its last position with `last_only`. The streamed head
        (pipeline/models/mtp_experts.py) goes on from here with its experts read."""
        x = mx.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)],
                           axis=-1)
        x = self.fc(x)
        layer = self.layer
        h = x + layer.self_attn(layer.input_layernorm(x), create_attention_mask(x, cache), cache)
        return h[:, -1:] if last_only else h


def load_mtp(root: Path, parts: TextParts, streamed: bool = False) -> MtpHead:
    """The container's head (`mtp_layers` in its manifest says there is one), evaluated;
    `streamed`: its routed experts are the container's `mtp_experts` (not loaded here)."""
    path = Path(root) / MTP_FILE
    weights = cast(dict[str, mx.array], mx.load(str(path)))  # a .safetensors file: a dict
    head = MtpHead(parts)
    if streamed:
        del head.layer.mlp["switch_mlp"]
        # A pack resumed across versions may have written them here too: not needed.
        weights = {n: a for n, a in weights.items() if not n.startswith(SWITCH)}
    if "fc.scales" in weights:
        # Quantized heads are 8-bit affine, group 64 (qpack.mtp); the rest stays float.
        nn.quantize(head, group_size=64, bits=8,
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise QpackError(path, f"MTP tensors do not match the model: {exc}") from None
    head.eval()
    mx.eval(head.parameters())
    return head


def head_bytes(root: Path) -> int:
    """What loading the head holds: its file (the dense part, or, packed before the
    experts were streamed, the experts too)."""
    return (Path(root) / MTP_FILE).stat().st_size
