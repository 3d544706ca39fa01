"""Build the resident dense core from a container with mlx-lm's own model classes.

mlx-lm's layers (attention, Gated DeltaNet, norms, router gates, shared experts)
are reused as they are; only the routed experts (`mlp.switch_mlp`, or the family's
`routed_module`) are cut
out before anything is materialised, so their random initialisers are never
evaluated and the core costs exactly the bytes of dense.safetensors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pipeline.models import deltanet_kernel
from pipeline.models.families import of_model
from pipeline.models.file_embedding import move_to_file, table_bytes
from pipeline.models.text_parts import text_parts
from qpack.families import family
from qpack.mlx_model import model_classes
from qpack.quant_infer import infer_quant_config
from qpack.quantize import flat_parameters
from qpack.safetensors_io import SafetensorsFile, load_safetensors
from qpack.spec import QpackError


def build_model(config: dict[str, Any]) -> nn.Module:
    """Instantiate the mlx-lm model for `config` with the routed experts removed."""
    deltanet_kernel.install()
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    routed = family(config.get("model_type")).routed_module
    for layer in model.layers:
        if routed in layer.mlp:
            del layer.mlp[routed]
    return model


def _quantize(model: nn.Module, config: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """Mirror mlx_lm.utils.load_model's quantization so the modules match the saved tensors."""
    quantization = config.get("quantization")
    if quantization is None:
        return

    def class_predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=class_predicate,
    )


def load_dense(config: dict[str, Any], dense_path: Path,
               keep: Callable[[str], bool] | None = None, *,
               embedding_on_file: bool = False, head_dtype: mx.Dtype | None = None) -> nn.Module:
    """The mlx-lm model holding every dense weight of the container, evaluated.

    `keep(name)`: load only those tensors (a pipeline rank's layers); the others become
    empty arrays, never read from the file (mx.load is lazy), so a stray use fails loudly.
    `embedding_on_file`: an untied token embedding stays in the file and is read by rows
    (pipeline/models/file_embedding.py); a tied one stays resident. `head_dtype`: the
    activations' dtype, which an untied quantized lm_head's scales are widened to
    (`widen_head`).
    """
    weights = load_safetensors(dense_path)
    model = build_model(config)
    _quantize(model, config, weights)
    expected = {name for name, _ in flat_parameters(model)}
    missing = sorted(expected - weights.keys())
    unexpected = sorted(weights.keys() - expected)
    if missing or unexpected:
        raise QpackError(
            dense_path,
            f"dense tensors do not match the {config.get('model_type')} model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}",
        )
    if keep is not None:
        weights = {name: (w if keep(name) else mx.zeros((0,), w.dtype)) for name, w in weights.items()}
    elif embedding_on_file:
        text = of_model(model).text_model(model)
        if not getattr(text.args, "tie_word_embeddings", False):
            move_to_file(model, text.model, weights, dense_path)
    model.load_weights(list(weights.items()), strict=keep is None)
    model.eval()
    mx.eval(model.parameters())
    weights.clear()  # the model holds every tensor: a widened head's narrow ones go at once
    widen_head(model, head_dtype)  # a pipeline rank without the head widens an empty one
    return model


def _widens(dtype: mx.Dtype | None, scales_dtype: mx.Dtype) -> bool:
    # None (the model's own dtype) compares to no Dtype: MLX's __eq__ refuses it.
    return dtype is not None and dtype == mx.float32 and scales_dtype in (mx.bfloat16, mx.float16)


def widen_head(model: nn.Module, dtype: mx.Dtype | None) -> None:
    """An untied quantized lm_head's scales and biases as wide as float32 activations.

    `quantized_matmul` casts narrower scales and biases to the activations' dtype on every
    call: 61 MiB of temporaries per decode step at Qwen3.5's 248k x 2,048 (measured), at
    the step's peak. Widened once they cost 30 MiB more resident and no call casts; the
    cast is exact, so the logits are the same bits (as the pool's `widen`)."""
    head = text_parts(model).lm_head  # None: tied (the embedding's dtype is its output's)
    if dtype is None or not isinstance(head, nn.QuantizedLinear) or not _widens(dtype, head.scales.dtype):
        return
    head.scales = head.scales.astype(dtype)
    if head.get("biases") is not None:
        head.biases = head["biases"].astype(dtype)
    mx.eval(head.parameters())
    # The narrow copies' buffers would stay in MLX's cache, resident, for good: no later
    # allocation has their size.
    mx.clear_cache()


def held_bytes(dense_path: Path, total: int, *, embedding_on_file: bool,
               head_dtype: mx.Dtype | None) -> int:
    """What the dense core of `total` bytes holds loaded with these options: less a token
    embedding left on file, plus an lm_head's widened scales and biases (from the header:
    before anything is loaded, for the memory plan)."""
    with SafetensorsFile(dense_path) as f:
        tensors = f.tensors
    held = total - (table_bytes(tensors) if embedding_on_file else 0)
    if head_dtype is not None and tensors and any(n.endswith("lm_head.weight") for n in tensors):
        narrow = {"BF16": mx.bfloat16, "F16": mx.float16}
        held += sum(t.nbytes for n, t in tensors.items()
                    if n.endswith(("lm_head.scales", "lm_head.biases"))
                    and t.dtype in narrow and _widens(head_dtype, narrow[t.dtype]))
    return held
