"""Synthetic checkpoints: real HF-format (or MLX-quantized) checkpoints with random weights.

    synthesize(out, "qwen3_next", "tiny")                      # bf16, the hub's layout
    synthesize(out, "qwen3_5_moe", "tiny", layout="per-expert")  # transformers' text-only class
    synthesize(out, "qwen3_next", "tiny", bits=4)               # what mlx_lm.convert -q writes

Layouts (each family's module, qpack.families, says where its tensors go):
- hub: the official release's names (per-expert `mlp.experts.{e}.{proj}.weight`, or fused
  `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] where the hub fuses them),
  zero-centred norms stored as the hub stores them. No vision weights are written
  (moestream is text-only); hub layouts of a family whose release has one carry the MTP
  head at the root (`mtp.*`, qpack/synth/mtp.py).
- per-expert: a second HF layout of the family where one exists (qwen3_5_moe: transformers
  5's text-only class), to test the packer on both.
- bits 4/8: mlx-lm's names after its `sanitize` (experts stacked as `mlp.switch_mlp.*`,
  norms +1 where the family's are zero-centred, conv1d [C, K, 1]), every Linear/Embedding
  quantized with `mx.quantize`, routers at 8 bits where the model's `quant_predicate`
  says so; the config gets mlx-lm's `quantization`.

Values are identical across layouts for one seed (see qpack.synth_init), and only one block
of one tensor (<= 4M values) is in memory at a time: the 80B preset writes with flat RSS.
"""

from __future__ import annotations

import errno
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import structlog

from qpack.families import family as family_of

if TYPE_CHECKING:
    from rich.progress import Progress

from qpack.output_guard import DiskSpaceError, bytes_under, require_free_space
from qpack.synth.init_weights import Init, WeightSource, to_storage
from qpack.synth.mlx_quant import (
    MIXED_RECIPES,
    MODE_DEFAULTS,
    mlx_plus_one,
    mlx_quantize,
    module_rule,
)
from qpack.synth.mtp import mtp_entries
from qpack.synth.presets import ModelDims, get_preset, hf_config
from qpack.synth.st_write import ST_DTYPES, TensorEntry, write_sharded
from qpack.synth.tensor_inits import dense_inits, expert_init
from qpack.synth.tokenizer import TokenizerSpec
from qpack.synth.variants import check_variant, generation_config

log = structlog.get_logger(__name__)

DEFAULT_SHARD_BYTES = 2 * 1024**3
TINY_SHARD_BYTES = 8 * 1024**2  # small enough that the tiny presets have several shards
Blocks = Callable[[], Iterator[np.ndarray]]


class WeightWriter:
    """Turns logical tensors into safetensors entries for one layout."""

    def __init__(self, dims: ModelDims, dtype: str, layout: str, bits: int | None,
                 group_size: int, src: WeightSource, mode: str = "affine",
                 recipe: str | None = None) -> None:
        self.dims, self.dtype, self.layout, self.bits, self.gs = dims, dtype, layout, bits, group_size
        self.mode, self.recipe = mode, recipe
        self.src = src
        self.mlx = bits is not None
        self.family = family_of(dims.family)
        self.prefix = self.family.synth_prefix(self.mlx, layout)
        self.head = self.family.synth_head(self.mlx)
        self.overrides: dict[str, dict[str, int]] = {}

    def entries(self, rel: str, init: Init) -> list[TensorEntry]:
        name = self.head if rel == "lm_head.weight" else self.prefix + rel
        blocks: Blocks = lambda: self.src.blocks(init)  # noqa: E731
        store = self.dtype
        fam = self.family
        if fam.float32_suffixes and rel.endswith(fam.float32_suffixes):
            store = "float32"  # kept in float32 by the hub and by mlx-lm's cast_predicate
        if not self.mlx:
            return [TensorEntry(name, ST_DTYPES[store], init.shape,
                                lambda: self.src.stored_blocks(init, store))]
        split = fam.mlx_split(rel, init, self.src.full, self.dims)
        if split is not None:  # sanitize cuts it (DeepSeek's kv_b_proj): write the parts
            out: list[TensorEntry] = []
            for part, shape, values in split:
                part_blocks = _one_block(values)
                quantized = part.endswith(fam.multi_linear)
                out += (self._quantized(self.prefix + part, shape, part_blocks) if quantized
                        else [self._plain(self.prefix + part, shape, part_blocks, store)])
            return out
        if fam.zero_centred and (rel.endswith(fam.zero_centred) or rel == "norm.weight"):
            return [self._plain(name, init.shape, blocks, store, plus_one=True)]
        if "conv1d" in rel:
            c, _, k = init.shape
            return [self._plain(name, (c, k, 1), blocks, store)]  # same bytes as [C, 1, K]
        if len(init.shape) == 2 and rel.endswith(".weight") and not (fam.not_quantized and rel.endswith(fam.not_quantized)):
            return self._quantized(name, init.shape, blocks)
        return [self._plain(name, init.shape, blocks, store)]

    def _plain(self, name: str, shape: tuple[int, ...], blocks: Blocks, store: str,
               plus_one: bool = False) -> TensorEntry:
        def chunks() -> Iterator[np.ndarray]:
            for b in blocks():
                yield mlx_plus_one(b, store) if plus_one else to_storage(b, store)

        return TensorEntry(name, ST_DTYPES[store], tuple(shape), chunks)

    def _quantized(self, name: str, shape: tuple[int, ...], blocks: Blocks) -> list[TensorEntry]:
        """weight/scales/biases of a (possibly expert-stacked) Linear, sharing one pass."""
        base = name.removesuffix(".weight")
        bits, gs, mode = self._rule(base)
        *lead, in_dim = shape
        if in_dim % gs:
            raise ValueError(f"tensor {name!r}: input dim {in_dim} is not a multiple of group size {gs}")
        stash: dict[str, list[np.ndarray]] = {}

        def weight() -> Iterator[np.ndarray]:
            stash.clear()
            scales, biases = [], []
            for b in blocks():
                q, s, z = mlx_quantize(b, self.dtype, bits, gs, mode)
                scales.append(s)
                biases.append(z)
                yield q
            stash.update(scales=scales, biases=biases)

        def part(which: str) -> Callable[[], Iterator[np.ndarray]]:
            def chunks() -> Iterator[np.ndarray]:
                if which in stash:  # written right after the weight: reuse that pass
                    yield from stash.pop(which)
                    return
                for b in blocks():
                    yield mlx_quantize(b, self.dtype, bits, gs, mode)[1 if which == "scales" else 2]

            return chunks

        st = ST_DTYPES[self.dtype] if mode == "affine" else "U8"  # fp modes: uint8 scales
        entries = [
            TensorEntry(f"{base}.weight", "U32", (*lead, in_dim * bits // 32), weight),
            TensorEntry(f"{base}.scales", st, (*lead, in_dim // gs), part("scales")),
        ]
        if mode == "affine":
            entries.append(TensorEntry(f"{base}.biases", st, (*lead, in_dim // gs), part("biases")))
        return entries

    def _rule(self, base: str) -> tuple[int, int, str]:
        bits, gs, mode, override = module_rule(base, self.bits or 4, self.gs, self.mode,
                                               self.recipe, self.dims.num_hidden_layers,
                                               self.family.routers_8bit)
        if override is not None:
            self.overrides[base] = override
        return bits, gs, mode

    def expert_entries(self, layer: int) -> list[TensorEntry]:
        d, p = self.dims, f"layers.{layer}.mlp."
        if not d.is_moe(layer):
            return []
        if (own := self.family.synth_experts(self, layer)) is not None:
            return own
        e_n, i, h = d.num_experts, d.moe_intermediate_size, d.hidden_size

        def stacked(*projs: str, store: str | None = None) -> Blocks:
            # One expert per block; `store` encodes directly (HF), None gives float32 (MLX).
            def one(init: Init) -> np.ndarray:
                if store is None:
                    return self.src.full(init)
                return np.concatenate(list(self.src.stored_blocks(init, store)), axis=0)

            def blocks() -> Iterator[np.ndarray]:
                for e in range(e_n):
                    parts = [one(expert_init(d, layer, e, pr)) for pr in projs]
                    yield np.concatenate(parts, axis=0)[None]

            return blocks

        if self.mlx:
            out: list[TensorEntry] = []
            for proj in ("gate_proj", "up_proj", "down_proj"):
                shape = (e_n, h, i) if proj == "down_proj" else (e_n, i, h)
                name = self.prefix + p + f"switch_mlp.{proj}.weight"
                if self.recipe == "float_experts":
                    # A predicate that leaves the routed experts unquantized: mlx-lm
                    # records `false` for them and saves their float weights.
                    # (`overrides` holds dicts, and mlx-lm's `false` for a module left out)
                    self.overrides[name.removesuffix(".weight")] = False  # type: ignore[assignment]
                    out.append(self._plain(name, shape, stacked(proj), self.dtype))
                    continue
                out += self._quantized(name, shape, stacked(proj))
            return out
        if self.family.fused_experts(self.layout):
            st = ST_DTYPES[self.dtype]
            return [
                TensorEntry(self.prefix + p + "experts.gate_up_proj", st, (e_n, 2 * i, h),
                            stacked("gate_proj", "up_proj", store=self.dtype)),
                TensorEntry(self.prefix + p + "experts.down_proj", st, (e_n, h, i),
                            stacked("down_proj", store=self.dtype)),
            ]
        out = []
        for e in range(e_n):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                init = expert_init(d, layer, e, proj)
                out += self.entries(f"layers.{layer}.mlp.experts.{e}.{proj}.weight", init)
        return out


def _one_block(values: Callable[[], np.ndarray]) -> Blocks:
    return lambda: iter([values()])


def checkpoint_entries(writer: WeightWriter, dims: ModelDims) -> list[TensorEntry]:
    """Every tensor of the checkpoint, in file order (embeddings, layer by layer, head)."""
    h, v = dims.hidden_size, dims.vocab_size
    entries = writer.entries("embed_tokens.weight",
                             Init("embed_tokens.weight", (v, h), "normal", 1.0))
    for layer in range(dims.num_hidden_layers):
        for rel, init in dense_inits(dims, layer):
            entries += writer.entries(rel, init)
        entries += writer.expert_entries(layer)
    entries += writer.entries("norm.weight", writer.family.norm_init("norm.weight", h))
    entries += writer.entries("lm_head.weight",
                              Init("lm_head.weight", (v, h), "normal", 1.0 / math.sqrt(h)))
    if not writer.mlx and writer.layout == "hub" and writer.family.mtp_head:
        # The MTP head, as the hub ships it (mlx_lm.convert drops it: no MLX layout has one).
        entries += mtp_entries(writer.src, dims, writer.dtype)
    return entries


def synthesize(
    out: Path,
    family: str | None,
    preset: str,
    *,
    dtype: str = "bfloat16",
    bits: int | None = None,
    group_size: int = 64,
    seed: int = 0,
    layout: str = "hub",
    shard_bytes: int | None = None,
    max_layers: int | None = None,
    tokenizer: bool = True,
    progress: bool = True,
    variant: str | None = None,
    mode: str = "affine",
    recipe: str | None = None,
    tokenizer_format: str = "json",
) -> Path:
    """Write a synthetic checkpoint of `family`/`preset` into directory `out`; returns `out`.

    `max_layers` truncates the model (config included) to its first layers: a smaller valid
    checkpoint, used to measure the full-size presets without writing all of them (mlx-lm
    needs at least `full_attention_interval` layers to run it). `variant` picks the chat
    template and generation_config.json (presets.VARIANTS: qwen3_next "instruct" or
    "thinking"); the weights do not depend on it. With `bits`, `mode` is mlx_lm.convert's
    --q-mode (affine, mxfp4, nvfp4, mxfp8: group size and bits then default to the mode's
    unless given) and `recipe` its --quant-predicate (mixed_3_6 etc.: down_proj and lm_head
    at the high bits in some layers, every module listed in the config; "float_experts":
    everything quantized but the routed experts). `tokenizer_format` "tiktoken" writes the
    tokenizer as Kimi-K2's release does (tiktoken.model, no tokenizer.json).
    """
    from qpack.synth.tokenizer_files import FORMATS, check_format

    dims = get_preset(family, preset)
    variant = check_variant(dims.family, variant, dims.name)
    if tokenizer:
        check_format(tokenizer_format, dims.family, variant, dims.bpe_ranks)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype {dtype!r}: expected bfloat16, float16 or float32")
    if mode not in MODE_DEFAULTS:
        raise ValueError(f"mode {mode!r}: expected one of {list(MODE_DEFAULTS)}")
    if recipe is not None and (recipe not in (*MIXED_RECIPES, "float_experts") or mode != "affine"):
        raise ValueError(f"recipe {recipe!r}: expected one of {[*MIXED_RECIPES, 'float_experts']} (affine only)")
    if mode != "affine" and bits is None:
        bits = MODE_DEFAULTS[mode][1]
    if mode != "affine" and group_size == 64:
        group_size = MODE_DEFAULTS[mode][0]
    if recipe is not None and bits is None:
        bits = MIXED_RECIPES[recipe][0] if recipe in MIXED_RECIPES else 4
    if bits not in (None, 2, 3, 4, 5, 6, 8):
        raise ValueError(f"bits {bits!r}: expected 2, 3, 4, 5, 6 or 8 (or None for unquantized)")
    if layout not in family_of(dims.family).layouts:
        wanted = " or ".join(repr(x) for x in family_of(dims.family).layouts)
        raise ValueError(f"layout {layout!r}: expected {wanted}")
    if bits is not None and layout != "hub":
        raise ValueError("bits: the MLX quantized layout has no per-expert variant; use layout='hub'")
    if max_layers is not None:
        if not 0 < max_layers <= dims.num_hidden_layers:
            raise ValueError(f"max_layers {max_layers}: expected 1..{dims.num_hidden_layers}")
        dims = msgspec.structs.replace(dims, num_hidden_layers=max_layers)
    if shard_bytes is None:
        shard_bytes = TINY_SHARD_BYTES if dims.name == "tiny" else DEFAULT_SHARD_BYTES
    out = Path(out)
    src = WeightSource(seed, dims.num_experts, dims.hidden_size)
    writer = WeightWriter(dims, dtype, layout, bits, group_size, src, mode, recipe)
    entries = checkpoint_entries(writer, dims)
    total = sum(e.nbytes for e in entries)
    # Shards of an earlier run are rewritten, so their bytes count as room.
    require_free_space(out, total, f"synth {dims.name}", already=bytes_under(out, "model*.safetensors*"))
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()

    log.info("synth.start", family=dims.family, preset=dims.name, dtype=dtype, bits=bits,
             layout=layout, layers=dims.num_hidden_layers, gb=round(total / 1e9, 3), out=str(out))
    metadata = {"format": "mlx" if bits else "pt"}
    with _progress(progress, total, f"synth {dims.family}/{dims.name}") as advance:
        tracked = [_tracked(e, advance) for e in entries]
        try:
            index = write_sharded(out, tracked, shard_bytes, metadata)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # Another writer took the room the check saw: say where, and free what we wrote.
            for partial in out.glob("model*.safetensors*"):
                partial.unlink(missing_ok=True)
            raise DiskSpaceError(out, "disk full (ENOSPC) while writing the checkpoint; its shards "
                                 "were removed: free space and re-run") from None

    config = hf_config(dims, dtype, layout)
    if bits is not None:
        quant: dict[str, object] = {"group_size": group_size, "bits": bits, "mode": mode}
        quant.update(dict(sorted(writer.overrides.items())))
        config.pop("vision_config", None)  # mlx_lm's save_config drops it too
        config["quantization"] = quant
        config["quantization_config"] = quant
    ids = TokenizerSpec(dims.family, variant, dims.bpe_ranks)  # the family writes its own ids
    (out / "config.json").write_text(json.dumps(ids.token_ids(config), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(ids.token_ids(generation_config(dims, variant)), indent=2) + "\n")
    if tokenizer:
        FORMATS[tokenizer_format](out, dims.family, variant, dims.bpe_ranks)
    log.info("synth.done", out=str(out), shards=len(set(index["weight_map"].values())),
             gb=round(total / 1e9, 3))
    return out


def _tracked(entry: TensorEntry, advance: Callable[[int], None]) -> TensorEntry:
    def chunks() -> Iterator[np.ndarray | bytes]:
        for c in entry.chunks():
            advance(c.nbytes if isinstance(c, np.ndarray) else len(c))
            yield c

    return TensorEntry(entry.name, entry.dtype, entry.shape, chunks)


class _progress:
    """A rich progress bar over bytes written, or nothing."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.enabled, self.total, self.label = enabled, total, label
        self._bar: Progress | None = None

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda n: None
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                             TransferSpeedColumn(), TimeRemainingColumn())
        self._bar.start()
        task = self._bar.add_task(self.label, total=self.total)
        bar = self._bar
        return lambda n: bar.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
