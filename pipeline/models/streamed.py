"""The forward pass, stepped one MoE layer at a time so expert reads can interleave.

A `ForwardStep` runs on the MLX thread. It advances through the decoder until the next
MoE layer's routing is known, evaluates only the top-k ids (the one host sync per MoE
layer), and hands them out; the caller makes those experts resident in the pool and
calls `advance`, which computes the routed experts from pool slots and runs on to the
next routing. Everything else stays lazy, so MLX fuses it into that single sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_ssm_mask

from actors.forward import Presync, Routing
from actors.slot_map import SlotMap, relative_slots
from pipeline.models.batch_caches import BatchCaches
from pipeline.models.file_embedding import FileEmbedding, embedding_dtype
from pipeline.models.kv_quant import KVQuant, quantize_caches
from pipeline.models.moe import routed_experts
from pipeline.models.routing_override import RoutingOverride
from pipeline.models.run_ahead import (
    LazyRunAhead,
    RunAhead,
    restore_cache,
    snapshot_cache,
    state_arrays,
)
from pipeline.models.text_parts import TextParts, moe_layers, text_parts
from pipeline.prefill_slices import mix, moe, moe_token_bytes, residual_bytes
from qpack.spec import ExpertFormat

# (layer, ids, hidden) -> the ids' pool slots, lazily (`ForwardStep.launch_with`).
Lookup = Callable[[int, mx.array, mx.array], mx.array]
# ... -> (slots relative to the layer's first, absolute slots or None: `ForwardStep._launch`)
SlotsOf = Callable[[int, mx.array, mx.array], tuple[mx.array, mx.array | None]]


class StreamedModel:
    """The resident dense core plus a view of the pool's slot arrays."""

    routing: RoutingOverride | None = None  # benchmark-only calibrated routing (bench --routing)
    slice_tokens: int = 1 << 30  # prefill mixers run in slices this long (pipeline/prefill_slices.py)
    moe_slice_tokens: int = 1 << 30  # and MoE halves in slices this long
    # (cache, final residual stream [rows, T, H]) after each forward: what an MTP drafter
    # reads (pipeline/models/mtp_drafter.py, fed by pipeline.speculation.HiddenSinks); None: nobody.
    # `behind`: tokens the caches already hold past this forward's (a paired step's: its
    # partner wrote them first; actors/pair_step.py).
    hidden_sink: Callable[[list[Any], mx.array, int], None] | None = None
    kv_quant: KVQuant | None = None  # attention's keys and values quantized (compute.kv_bits)

    def __init__(
        self,
        model: nn.Module,
        fmt: ExpertFormat,
        slot_arrays: dict[str, mx.array],
        activation_dtype: mx.Dtype | None = None,
        views: Callable[[int], tuple[dict[str, mx.array], ExpertFormat, int]] | None = None,
        layers: range | None = None,
    ):
        self.model = model
        self.activation_dtype = activation_dtype  # None: whatever the embedding yields
        self.parts: TextParts = text_parts(model)
        self.family = self.parts.family
        self.fmt = fmt
        self.slot_arrays = slot_arrays  # owned by the pool, updated in place on install
        # layer -> (its slot arrays, its format, their first slot): the pool's `view`.
        self.views = views
        self.num_layers = len(self.parts.layers)
        # The layers this process runs (pipeline-parallel ranks run a slice: pipeline/distributed).
        self.layers = layers if layers is not None else range(self.num_layers)
        self.moe_layers = [i for i in moe_layers(self.parts) if i in self.layers]
        self.num_experts, self.top_k = self.family.experts(self.parts.layers[self.moe_layers[0]].mlp)
        # An embedding on file reads token ids on the host (actors/forward.py SteppedModel).
        self.tokens_on_host = isinstance(self.parts.embed_tokens, FileEmbedding)

    def step(self, tokens: list[int] | mx.array, cache: list[Any]) -> ForwardStep:
        return ForwardStep(self, tokens, cache)

    def step_after(self, tokens: list[int], cache: list[Any], before: int) -> ForwardStep | None:
        """A step over one sequence's `tokens` that will run, layer by layer, right after
        another step over `before` tokens has run that layer (actors/pair_step.py): built
        now, before the caches hold those tokens. None where that would change the step:
        a mask (made here from the caches) that is not None, as it is for one token."""
        step = ForwardStep(self, tokens, cache)
        if any(m is not None for m in (step.fa_mask, step.ssm_mask, step.swa_mask)):
            return None
        if step.where is not None:  # calibrated routing: its positions come after `before`
            positions, requests = step.where
            step.where = ([p + before for p in positions], requests)
        return step

    def batch_caches(self) -> BatchCaches:
        return BatchCaches(self.layers)

    def state_bytes(self, tokens: int) -> int:
        """About how many bytes one sequence's model state holds after `tokens` tokens:
        keys and values per attention layer (allocated 256 positions at a time), a fixed
        state per recurrent layer (the family's `state_bytes`)."""
        positions = -(-tokens // 256) * 256
        itemsize, quant, family = self._itemsize(), self.kv_quant, self.family
        total = 0
        for block in self.parts.layers:
            n = family.state_bytes(block, self.parts.args, positions, itemsize)
            if quant is not None and not family.is_linear(block) and not family.is_sliding(block):
                n = int(n * quant.element_bytes(itemsize) / itemsize)
            total += n
        return total

    def moe_token_bytes(self) -> int:
        """Temporaries a prompt token adds to a MoE layer (pipeline/prefill_slices.py)."""
        args = self.parts.args
        inter = getattr(args, "moe_intermediate_size", None) or args.intermediate_size
        return moe_token_bytes(self.top_k, args.hidden_size, inter, self._itemsize())

    def chunk_bytes(self, tokens: int) -> int:
        """What a prefill chunk of `tokens` holds whole beside its slices."""
        return residual_bytes(tokens, self.parts.args.hidden_size, self._itemsize())

    def state_variant(self) -> str:
        """What a state's bits depend on beyond the container and the code: the
        activations' dtype and the KV cache's quantization ("float32", "bfloat16-kv4g64")."""
        kv = f"-kv{self.kv_quant.bits}g{self.kv_quant.group_size}" if self.kv_quant else ""
        return str(self.compute_dtype()).rsplit(".", 1)[-1] + kv

    def compute_dtype(self) -> mx.Dtype:
        """The activations' dtype: the compute dtype, else the embedding's."""
        return self.activation_dtype or embedding_dtype(self.parts.embed_tokens)

    def _itemsize(self) -> int:
        """Bytes of an activation's element."""
        return self.compute_dtype().size

    def step_from(self, hidden: mx.array, cache: list[Any]) -> ForwardStep:
        """A forward over `self.layers` that starts from the residual stream `hidden`
        [rows, tokens, H] (another rank's output) instead of embedding tokens."""
        return ForwardStep(self, [], cache, hidden=hidden)

    def experts(self, layer: int) -> tuple[dict[str, mx.array], ExpertFormat, int]:
        """`layer`'s slot arrays, format and first slot (a bank's: actors/pool/banks.py)."""
        return self.views(layer) if self.views else (self.slot_arrays, self.fmt, 0)

    def make_cache(self) -> list[Any]:
        cache = self.parts.make_cache()
        if self.kv_quant is not None:
            quantize_caches(cache, self.kv_quant)
        return cache if self.routing is None else self.routing.tag(cache)

    def router_logits(self, layer: int, hidden: mx.array) -> mx.array:
        """Layer `layer`'s router applied to a residual-stream state (for next-gate prefetch)."""
        if self.routing is not None and self.routing.emulate_gate:
            return self.routing.gate_logits(layer, hidden)
        return self.family.router_scores(self.parts.layers[layer], hidden)


def activation_dtype(setting: str) -> mx.Dtype | None:
    """The dtype a `compute.dtype` setting asks for on this machine's default device."""
    if setting == "model":
        return None
    if setting == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    return getattr(mx, setting)


class ForwardStep:
    """One forward call over `tokens` (a prefill chunk or one decode token)."""

    def __init__(self, model: StreamedModel, tokens: list[int] | mx.array, cache: list[Any],
                 hidden: mx.array | None = None):
        """`tokens`: one sequence's ids (a list, or a lazy 1-D array: a token not yet read
        back, pipelined decode), or a [rows, tokens] array: one row per sequence of a
        batch whose caches were merged (`BatchCaches`); its logits are then [rows, vocab].
        Or `hidden`, the residual stream entering `model.layers` (a later pipeline rank).
        """
        self.m = model
        self.cache = cache
        # A later rank's batch arrives as a residual stream of several rows.
        self.rows = ((isinstance(tokens, mx.array) and tokens.ndim == 2)
                     or (hidden is not None and hidden.shape[0] > 1))
        if hidden is None:
            if isinstance(tokens, mx.array):
                ids = tokens if self.rows else tokens.reshape(1, -1)
            else:
                ids = mx.array([tokens])
            h = model.parts.embed_tokens(ids)
            if model.activation_dtype is not None:
                h = h.astype(model.activation_dtype)
        else:
            h = hidden
        # Masks from this process's own layers' caches: a rank never updates the others'.
        local = [(i, model.parts.layers[i]) for i in model.layers]
        linear, sliding = model.family.is_linear, model.family.is_sliding
        first_fa = next((i for i, b in local if not linear(b) and not sliding(b)), None)
        first_ssm = next((i for i, b in local if linear(b)), None)
        first_swa = next((i for i, b in local if sliding(b)), None)
        self.fa_mask = None if first_fa is None else model.family.attention_mask(h, cache[first_fa])
        self.ssm_mask = None if first_ssm is None else create_ssm_mask(h, cache[first_ssm])
        self.swa_mask = None if first_swa is None else model.family.sliding_mask(h, cache[first_swa])
        self.h = h
        # Each row's (position, request) before this step's tokens: calibrated routing only.
        self.where = None if model.routing is None else model.routing.where(cache)
        self.layer = model.layers.start
        self._pending: tuple[mx.array, mx.array, mx.array, mx.array] | None = None
        self._snapshot: list[dict[str, Any]] | None = None
        self._h_in: dict[int, mx.array] = {}

    def _mask(self, block: nn.Module) -> Any:
        if self.m.family.is_linear(block):
            return self.ssm_mask
        return self.swa_mask if self.m.family.is_sliding(block) else self.fa_mask

    def _to_next_moe(self) -> nn.Module | None:
        """Run the dense layers up to the next MoE layer (lazily); that block, or None."""
        while self.layer < self.m.layers.stop:
            block = self.m.parts.layers[self.layer]
            if self.layer in self.m.moe_layers:
                return block
            self.h = block(self.h, mask=self._mask(block), cache=self.cache[self.layer])
            self.layer += 1
        return None

    def _mix_and_route(self, block: nn.Module) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The MoE block's attention / DeltaNet half and its router: (h_mid, x, ids, scores)."""
        h_mid = self.h + self._mixed(block)
        x = block.post_attention_layernorm(h_mid)
        forced = None
        if self.m.routing is not None:
            assert self.where is not None
            forced = self.m.routing.ids(self.layer, self.where, x.shape[-2])
        inds, scores = self.m.family.route(block.mlp, x, forced)
        return h_mid, x, inds, scores

    def _mixed(self, block: nn.Module) -> mx.array:
        """The MoE block's mixer (attention or DeltaNet) over this step's tokens, its cache updated."""
        return mix(self.m.family.mixer(block), block.input_layernorm(self.h), self._mask(block),
                   self.cache[self.layer], self.m.slice_tokens)

    def run_to_routing(self, presync: Presync | None = None) -> Routing | None:
        """Advance to the next MoE layer's routing; None once every layer has run.

        `presync(layer, hidden)` may return more lazy arrays (a prefetch prediction) to
        evaluate in the same sync as the routing.
        """
        block = self._to_next_moe()
        if block is None:
            return None
        h_mid, x, inds, scores = self._mix_and_route(block)
        hidden = h_mid.reshape(-1, h_mid.shape[-1])  # [rows * tokens, H]
        extra = presync(self.layer, hidden) if presync is not None else []
        mx.eval(inds, *extra)
        self._pending = (h_mid, x, inds, scores)
        ids = np.asarray(inds).reshape(-1, inds.shape[-1])
        return Routing(self.layer, ids, hidden)

    def advance(self, slot_of: np.ndarray, presync: Presync | None = None) -> Routing | None:
        """Finish the pending MoE layer; `slot_of[e]` is expert e's pool slot (needed ones only)."""
        assert self._pending is not None, "advance() without a pending routing"
        h_mid, x, inds, scores = self._pending
        self._pending = None
        block = self.m.parts.layers[self.layer]
        arrays, fmt, first = self.m.experts(self.layer)
        slots = mx.array(relative_slots(slot_of, first))[inds]

        def part(x: mx.array, slots: mx.array, scores: mx.array) -> mx.array:
            routed = routed_experts(arrays, fmt, x, slots, self.m.family.activation)
            return self.m.family.moe_output(block.mlp, x, routed, scores)

        self.h = h_mid + moe(part, x, slots, scores, self.m.moe_slice_tokens)
        self.layer += 1
        return self.run_to_routing(presync)

    def run_ahead(self, slot_map: SlotMap) -> RunAhead:
        """`launch` then evaluate at once (see `launch`)."""
        lazy = self.launch(slot_map)
        mx.eval(lazy.arrays())
        return lazy.result()

    def launch(self, slot_map: SlotMap) -> LazyRunAhead:
        """The whole token from the pool's table of ready experts (see `_launch`): each
        layer's slots one gather from `slot_map`, "every expert present" answered on the
        host from the same table once the ids are read (actors/slot_map.py: no kernel)."""
        def first_of(layer: int) -> int:
            return self.m.experts(layer)[2]

        return self._launch(lambda layer, inds, _hidden: (slot_map.lookup(layer, inds, first_of), None), slot_map)

    def launch_with(self, lookup: Lookup) -> LazyRunAhead:
        """The whole token, each MoE layer's absolute slots from `lookup(layer, ids,
        hidden)` (lazy; -1 = absent; `hidden`: the residual stream after its attention,
        [rows * tokens, H]): a wait for the host (actors/device_wait.py), whose answer
        also says on the device whether every expert was there."""
        def relative(layer: int, inds: mx.array, hidden: mx.array) -> tuple[mx.array, mx.array | None]:
            found = lookup(layer, inds, hidden)
            return mx.maximum(found - self.m.experts(layer)[2], 0), found

        return self._launch(relative, None)

    def _launch(self, slots_of: SlotsOf, table: SlotMap | None) -> LazyRunAhead:
        """The whole token in one evaluation. `slots_of(layer, ids, hidden)`: the ids'
        slots relative to the layer's first (lazy), and with no `table` (the map they came
        from) their absolute slots, -1 = absent, for the device's flags. A missing expert
        reads slot 0: its output is wrong and is thrown away. The logits, every MoE
        layer's ids (and "all present" flags, without a table) and the residual stream
        entering each MoE layer are evaluated together: the token's one host sync. The
        caches are snapshotted first, so `resume(layer)` can restart exactly at the first
        layer that missed."""
        self._snapshot = [snapshot_cache(c) for c in self.cache]
        ids: list[mx.array] = []
        found_all: list[mx.array] = []
        layers: list[int] = []
        while (block := self._to_next_moe()) is not None:
            self._h_in[self.layer] = self.h
            h_mid, x, inds, scores = self._mix_and_route(block)
            slots, found = slots_of(self.layer, inds, h_mid.reshape(-1, h_mid.shape[-1]))
            if found is not None:
                found_all.append(found)
            arrays, fmt, _ = self.m.experts(self.layer)
            routed = routed_experts(arrays, fmt, x, slots, self.m.family.activation)
            self.h = h_mid + self.m.family.moe_output(block.mlp, x, routed, scores)
            ids.append(inds.reshape(-1, inds.shape[-1]))
            layers.append(self.layer)
            self.layer += 1
        states = [a for c in self.cache for a in state_arrays(c.state)]
        self._to_sink()
        present: mx.array | SlotMap
        if table is not None:
            present = table
        else:
            # "All present" per layer from one stack of the layers' slots: three kernels a
            # token, not two a layer (a decode step is kernel-launch bound on a GPU).
            present = (mx.stack(found_all).reshape(len(found_all), -1) >= 0).all(axis=1)
        return LazyRunAhead(layers, ids, present, self._last_logits(),
                            [*self._h_in.values(), *states])

    def _last_logits(self) -> mx.array:
        """The last position's logits: [vocab], or [rows, vocab] for a batch of rows."""
        out = self.m.parts.head(self.m.parts.norm(self.h[:, -1:, :]))
        return out[:, 0] if self.rows else out[0, 0]

    def _to_sink(self, behind: int = 0) -> None:
        if self.m.hidden_sink is not None:  # a batch's rows too: the sink splits them
            self.m.hidden_sink(self.cache, self.h, behind)

    def restore(self, snapshot: list[dict[str, Any]], layers: range) -> None:
        """Put `layers`' caches back as `snapshot` (a `snapshot()`) had them."""
        for i in layers:
            restore_cache(self.cache[i], snapshot[i])

    def snapshot(self) -> list[dict[str, Any]]:
        """The caches as they are before this step (taken by `launch`)."""
        assert self._snapshot is not None
        return self._snapshot

    def resume(self, layer: int, presync: Presync | None = None) -> Routing | None:
        """After a run-ahead that missed at `layer`: undo it from there, step on as usual.

        Layers before `layer` computed with every expert present, so their cache updates
        stand; the caches from `layer` on go back to the snapshot and the residual stream
        to what entered `layer`, which the per-layer path then recomputes with the same
        kernels (bit-identical to never having run ahead).
        """
        assert self._snapshot is not None, "resume() without run_ahead()"
        for i in range(layer, self.m.layers.stop):
            restore_cache(self.cache[i], self._snapshot[i])
        self.h = self._h_in[layer]
        self.layer = layer
        self._snapshot = None
        self._h_in.clear()
        return self.run_to_routing(presync)

    def end(self) -> None:
        """The forward's end without logits (a step paired before another): its final
        residual stream and the caches evaluated; the hidden sink is fed by `sink`."""
        mx.eval(self.h, [a for c in self.cache for a in state_arrays(c.state)])

    def sink(self, behind: int) -> None:
        """Feed the hidden sink (`end`'s step), once the caches hold `behind` more tokens."""
        self._to_sink(behind)

    def logits(self, all_positions: bool = False) -> mx.array:
        """Final logits, [vocab] for the last position (or [tokens, vocab]); evaluated."""
        if all_positions:
            out = self.m.parts.head(self.m.parts.norm(self.h))[0]
        else:
            out = self._last_logits()
        self._to_sink()
        mx.eval(out, [a for c in self.cache for a in state_arrays(c.state)])
        return out
