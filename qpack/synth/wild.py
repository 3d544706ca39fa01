"""Checkpoint layouts found in the wild, derived from a synthetic checkpoint.

`derive(src, out, kind)` writes `out` as `src` re-saved the way some tool or community
upload saves it; unchanged shards are symlinked, so a variant costs only what differs.

- `tf5-rope` (qwen3_next): config.json as transformers 5 re-saves it: `rope_theta` and
  `partial_rotary_factor` only inside `rope_parameters`.
- `mlx-vision-tower` (qwen3_5_moe, MLX): a community MLX conversion that kept the vision
  tower under `language_model.vision_tower.*`, in a shard of its own.
- `extra-shards` (qwen3_5_moe hub): the hub's MTP head and vision tower in shards that
  hold no text-model tensor (`mtp.*`, `model.visual.*`), listed in the index.
- `gptq`, `awq`, `fp8-per-tensor`: config.json with that `quantization_config`
  (the weights are left as they are: these kinds are refused before any is read).
- `gguf`: a GGUF-only repo (a `.gguf` file, a README, no config.json).
- `fp8-block`: an official "-FP8" repo: Linear weights (routed experts included) as
  float8 e4m3 with a float32 `weight_scale_inv` per FP8_BLOCK block, embeddings, head,
  routers and norms left in bf16 (`modules_to_not_convert`); the shards are rewritten.
- `fp8-channel`: an llm-compressor "-FP8" repo (GLM-4.5 / 4.6's): `compressed-tensors`,
  `float-quantized`, the same weights as e4m3 with a bf16 `weight_scale` [rows, 1] per
  output row (`strategy: channel`, dynamic per-token activations), head and routers in
  `ignore`.
- `fp8-ct-block`: llm-compressor's FP8_BLOCK scheme (`compressed-tensors`, `strategy: block`,
  `block_structure` FP8_BLOCK): float32 `weight_scale` per block, and static per-tensor
  activation scales (`input_scale`, which a weight read has no use for) beside them.
- `nvfp4-global-scale` (MLX nvfp4): what `mlx_lm.convert --q-mode nvfp4 --global-scale`
  records in the config (one tensor scale per expert; only the config is changed).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qpack.synth.st_write import TensorEntry, write_safetensors

KINDS = ("tf5-rope", "mlx-vision-tower", "extra-shards", "gptq", "awq", "fp8-per-tensor", "gguf",
         "nvfp4-global-scale", "fp8-block", "fp8-channel", "fp8-ct-block")
# Smaller than the hub's 128 x 128 and not dividing the tiny dims: partial edge blocks and
# rows vs columns both get exercised.
FP8_BLOCK = (32, 48)
_NOT_CONVERTED = ("embed_tokens", "lm_head", "mlp.gate.", "shared_expert_gate", "conv1d", "norm")
INDEX = "model.safetensors.index.json"
_QUANT: dict[str, dict[str, object]] = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
    "fp8-per-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
}


def _later(make: Callable[..., Any], *args: Any) -> Callable[[], list[Any]]:
    """A tensor's data, made when it is written (`make(*args)`): the arguments are bound
    now, as a lambda's default argument would bind them, but typed."""
    return lambda: [make(*args)]


def _link_all(src: Path, out: Path, skip: tuple[str, ...] = ()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in skip and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())


def _rewrite_json(path: Path, data: dict) -> None:
    if path.is_symlink():
        path.unlink()
    path.write_text(json.dumps(data, indent=2) + "\n")


def _add_shard(out: Path, name: str, tensors: dict[str, tuple[int, ...]]) -> None:
    """A shard of small float32 tensors (random), added to the index."""
    rng = np.random.default_rng(0)
    entries = [TensorEntry(t, "F32", shape, _later(rng.standard_normal, shape, np.float32))
               for t, shape in tensors.items()]
    write_safetensors(out / name, entries, {"format": "pt"})
    index = json.loads((out / INDEX).read_text())
    index["weight_map"].update({t: name for t in tensors})
    _rewrite_json(out / INDEX, index)


def derive(src: Path, out: Path, kind: str) -> Path:
    src, out = Path(src), Path(out)
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: expected one of {list(KINDS)}")
    if kind == "gguf":
        out.mkdir(parents=True, exist_ok=True)
        (out / "model-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(60))
        (out / "README.md").write_text("# a GGUF upload\n")
        return out
    config = json.loads((src / "config.json").read_text())
    _link_all(src, out)
    if kind == "tf5-rope":
        if config["model_type"] != "qwen3_next":
            raise ValueError("tf5-rope derives from a qwen3_next checkpoint")
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta"),
                                     "partial_rotary_factor": config.pop("partial_rotary_factor")}
        config.pop("rope_scaling", None)
        config["transformers_version"] = "5.0.0"
    elif kind == "fp8-block":
        _to_fp8(src, out, _fp8_block, "_scale_inv")
        config["quantization_config"] = {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(FP8_BLOCK), "modules_to_not_convert": ["lm_head", "embed_tokens", "mlp.gate"]}
    elif kind in ("fp8-channel", "fp8-ct-block"):
        channel = kind == "fp8-channel"
        _to_fp8(src, out, _fp8_channel if channel else _fp8_block, "_scale", input_scale=not channel)
        text = config.get("text_config", config)
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
                   "strategy": "channel" if channel else "block",
                   "block_structure": None if channel else list(FP8_BLOCK)}
        inputs = ({"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
                  if channel else {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                                   "dynamic": False})
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None,
                                          "weights": weights, "input_activations": inputs}},
            "ignore": ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(text["num_hidden_layers"]))]}
    elif kind in _QUANT:
        config["quantization_config"] = dict(_QUANT[kind])
    elif kind == "nvfp4-global-scale":
        quant = config["quantization"]
        prefix = "language_model.model" if "text_config" in config else "model"
        text = config.get("text_config", config)
        for layer in range(text["num_hidden_layers"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                quant[f"{prefix}.layers.{layer}.mlp.switch_mlp.{proj}"] = {
                    "group_size": 16, "bits": 4, "mode": "nvfp4", "global_scale": True}
        config["quantization_config"] = quant
    elif kind == "mlx-vision-tower":
        if "quantization" not in config:
            raise ValueError("mlx-vision-tower derives from an MLX-quantized qwen3_5_moe checkpoint")
        _add_shard(out, "model-vision.safetensors", {
            "language_model.vision_tower.blocks.0.attn.qkv.weight": (48, 16),
            "language_model.vision_tower.patch_embed.proj.weight": (16, 3, 2, 4, 4),
        })
    elif kind == "extra-shards":
        text = config.get("text_config", config)
        h = text["hidden_size"]
        _add_shard(out, "model-mtp.safetensors", {"mtp.fc.weight": (h, 2 * h),
                                                  "mtp.norm.weight": (h,)})
        _add_shard(out, "model-visual.safetensors", {"model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4),
                                                     "model.visual.merger.linear_fc1.weight": (16, 16)})
    _rewrite_json(out / "config.json", config)
    return out


def _fp8_block(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 bytes and float32 scale_inv per FP8_BLOCK block of the last two axes."""
    import mlx.core as mx

    b0, b1 = FP8_BLOCK
    *lead, rows, cols = w.shape
    nr, nc = -(-rows // b0), -(-cols // b1)
    pad = np.zeros((*lead, nr * b0, nc * b1), dtype=np.float32)
    pad[..., :rows, :cols] = w
    blocks = pad.reshape(*lead, nr, b0, nc, b1)
    scale = np.abs(blocks).max(axis=(-3, -1)) / 448.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    scaled = (blocks / scale[..., :, None, :, None]).reshape(pad.shape)[..., :rows, :cols]
    q = np.array(mx.to_fp8(mx.array(np.ascontiguousarray(scaled))))
    return q, scale


def _fp8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 bytes and a bf16 scale [.., rows, 1] per output row (llm-compressor's channel
    FP8; the scale rounded to bf16 first, so the weights are divided by what is stored)."""
    import mlx.core as mx

    scale = np.abs(w).max(axis=-1, keepdims=True) / 448.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    stored = mx.array(scale).astype(mx.bfloat16)
    q = np.array(mx.to_fp8(mx.array(w) / stored.astype(mx.float32)))
    return q, np.array(stored.view(mx.uint16))


def _to_fp8(src: Path, out: Path, quantize: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
            suffix: str, input_scale: bool = False) -> None:
    """Rewrite every shard: eligible Linear weights become e4m3 + their scale (`suffix`),
    and with `input_scale` a static float32 activation scale [1] (`x.input_scale`)."""
    from qpack.safetensors_io import SafetensorsFile, bytes_to_mx

    index = json.loads((src / INDEX).read_text())
    weight_map: dict[str, str] = {}
    for shard in sorted(set(index["weight_map"].values())):
        entries: list[TensorEntry] = []
        with SafetensorsFile(src / shard) as f:
            for name, info in f.tensors.items():
                data = f.read_bytes(name)
                convert = (info.dtype in ("BF16", "F16", "F32") and len(info.shape) in (2, 3)
                           and (name.endswith(".weight") or ".experts." in name)
                           and not any(k in name for k in _NOT_CONVERTED))
                if not convert:
                    entries.append(TensorEntry(name, info.dtype, info.shape, _later(bytes, data)))
                    weight_map[name] = shard
                    continue
                import mlx.core as mx

                w = np.array(bytes_to_mx(data, info.dtype, info.shape).astype(mx.float32))
                q, scale = quantize(w)
                entries.append(TensorEntry(name, "F8_E4M3", info.shape, _later(np.asarray, q)))
                tag = "BF16" if scale.dtype == np.uint16 else "F32"  # bf16 travels as its bits
                entries.append(TensorEntry(name + suffix, tag, scale.shape, _later(np.asarray, scale)))
                weight_map[name] = weight_map[name + suffix] = shard
                if input_scale:
                    module = name.removesuffix(".weight")
                    entries.append(TensorEntry(module + ".input_scale", "F32", (1,),
                                               _later(np.full, (1,), 0.05, np.float32)))
                    weight_map[module + ".input_scale"] = shard
        (out / shard).unlink()
        write_safetensors(out / shard, entries, {"format": "pt"})
    index["weight_map"] = weight_map
    _rewrite_json(out / INDEX, index)
