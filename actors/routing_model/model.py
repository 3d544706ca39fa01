"""A seeded generative model of MoE routing: who a router picks, token after token.

Random-weight containers route uniformly, so a pool then hits at about slots / experts
whatever the policy. Trained routers do not: published measurements (cited in
actors/routing_model/families.py) show per-layer popularity skew, strong reuse across
nearby tokens, a core of "universal" experts every domain uses, and hot sets that move
between prompt domains. This model has one mechanism per effect, each a term of a
per-(token, layer) logit vector over the experts; the router's top-k of those logits plus
Gumbel noise is the routing (Gumbel-top-k = sampling k experts without replacement with
probabilities proportional to exp(logit)):

    logit[l, e] = base[d, l, e]                     popularity in domain d (skew, universal)
                + latent_scale * (W[l] @ z_t)[e]     what the current context asks for
                + reuse * r_t[l, e]                  self-excitation: recently used experts
    base[d, l]  = skew * (sqrt(1 - m_l) g[l] + sqrt(m_l) h[d, l]) + universal_boost * U[l]
    z_t         = persistence * z_(t-1) + sqrt(1 - persistence^2) * eps_t   (per request)
    r_t         = reuse_decay * r_(t-1) + onehot(chosen at t-1)

plus, with `explore` > 0, about explore x k experts per (token, layer) forced in uniformly
at random (one-off picks: the tail that keeps even a large cache from hitting more).
g, h, W, eps are standard normal; U marks `universal_fraction` of each layer's experts;
m_l (domain specificity) goes from `domain_mix_early` at layer 0 to `domain_mix_late` at
the last layer (as (1 - depth)^domain_mix_power), since published hot sets differ more between domains
in early layers. The latent z is shared by all layers of a token, which correlates layer
l's choice with layer l+1's: what `transition` and gate-ahead prefetch exploit.

The emulated gate-ahead (a next-gate prefetcher) guesses layer l+1's routing from layer
l+1's deterministic logits plus `gate_share` of the routing's own per-token noise plus
fresh Gumbel noise of scale `gate_noise`. The routing noise stands for everything that
sets one token apart beyond the shared context, and a real gate applied to a token's own
hidden state sees most of that token; with `gate_share` 0 the gate saw only the context,
so its guesses for consecutive tokens were nearly one set (0.92 overlap against the
routing's 0.42 on the 35B): a verify pass's union of guesses then covered far fewer of
the union routed than one token's guess covers of its own. The two are fitted together
(benchmarks/gate_fit.py): the per-token recall near the published ~46 % (where the
family's routing allows it), and the guesses' consecutive-token overlap equal to the
routing's. One-off picks (`explore`) stay unseen: nothing predicts them.

Everything is numpy, seeded, and independent of qpack and MLX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np


class RoutingShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    num_layers: int
    num_experts: int
    top_k: int


class RoutingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    skew: float  # std of log-popularity: larger = a few experts take more of the picks
    latent_scale: float  # weight of the per-token context: larger = less popularity-bound
    persistence: float  # AR(1) coefficient of the context across tokens (temporal reuse)
    reuse: float  # self-excitation weight of recently used experts
    reuse_decay: float  # per-token decay of the self-excitation trace
    universal_fraction: float = 0.15  # share of each layer's experts hot in every domain
    universal_boost: float = 2.0  # log-popularity added to the universal experts
    domain_mix_early: float = 0.9  # domain-specific share of log-popularity, first layer
    domain_mix_late: float = 0.06  # ... last layer
    domain_mix_power: float = 5.0  # m_l = late + (early - late) * (1 - depth)^power
    explore: float = 0.0  # expected share of picks that are one-offs, uniform over experts
    gate_noise: float = 1.0  # Gumbel scale of the emulated gate-ahead predictor's own error
    gate_share: float = 0.0  # share of the routing's per-token noise the emulated gate sees
    latent_dim: int = 16
    num_domains: int = 8


class RoutingModel:
    """Draw routing for requests: `tokens(domain, n)` -> int32 [n, layers, top_k]."""

    def __init__(
        self,
        shape: RoutingShape,
        params: RoutingParams,
        seed: int = 0,
        depths: Sequence[float] | None = None,
    ) -> None:
        """`depths`: each layer's relative depth in 0..1 (default evenly from 0 to 1); a few
        layers standing for a deep model take depths spread over it (the domain mix moves
        with depth). Nothing else depends on it: the random draws are the same."""
        if not 0 < shape.top_k <= shape.num_experts:
            raise ValueError(f"routing model: top_k {shape.top_k} not in 1..{shape.num_experts}")
        if not 0.0 <= params.persistence < 1.0 or not 0.0 <= params.reuse_decay < 1.0:
            raise ValueError("routing model: persistence and reuse_decay must be in [0, 1)")
        self.shape, self.params, self.seed = shape, params, seed
        L, E, p = shape.num_layers, shape.num_experts, params
        rng = np.random.default_rng([seed, 0x5EED])
        if depths is not None and len(depths) != L:
            raise ValueError(f"routing model: {len(depths)} depths for {L} layers")
        if depths is not None:
            depth = np.asarray(depths, dtype=float)[:, None]
        else:
            depth = np.linspace(0.0, 1.0, L)[:, None] if L > 1 else np.zeros((1, 1))
        mix = p.domain_mix_late + (p.domain_mix_early - p.domain_mix_late) * (1 - depth) ** p.domain_mix_power
        shared = rng.standard_normal((L, E))
        per_domain = rng.standard_normal((p.num_domains, L, E))
        n_univ = int(round(p.universal_fraction * E))
        self.universal = np.zeros((L, E), dtype=bool)
        for layer in range(L):
            self.universal[layer, rng.permutation(E)[:n_univ]] = True
        self.base = p.skew * (np.sqrt(1 - mix) * shared + np.sqrt(mix) * per_domain)
        self.base += p.universal_boost * self.universal
        # Scaled so that latent_scale is the std of the context term per expert.
        self.proj = rng.standard_normal((L, E, p.latent_dim)) / math.sqrt(p.latent_dim)

    def tokens(
        self, domain: int, n: int, rng: np.random.Generator, *, gate: bool = False,
        gate_ranks: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Routing of one request's `n` tokens in `domain`: ids [n, L, k], router order.

        With gate=True also the emulated gate-ahead predictions [n, L, gate_ranks] for each
        layer, best first (row l predicts layer l from layer l-1's state; row 0 is unused).
        `gate_ranks` (default k) > k ranks experts past the gate's top-k as a real gate's
        scores do: what a prefetcher that reads more than top-k per layer picks. The
        first k are the same whatever `gate_ranks` is (the same noisy scores, sorted).
        """
        L, E, k = self.shape.num_layers, self.shape.num_experts, self.shape.top_k
        g = min(E, gate_ranks or k)
        p = self.params
        base = self.base[domain % p.num_domains]
        # The gate's noise has its own stream, so asking for it leaves the routing unchanged.
        gate_rng = np.random.default_rng(rng.integers(2**63))
        z = rng.standard_normal(p.latent_dim)
        trace = np.zeros((L, E))
        out = np.empty((n, L, k), dtype=np.int32)
        gates = np.empty((n, L, g), dtype=np.int32) if gate else None
        innov = math.sqrt(1.0 - p.persistence**2)
        rows = np.arange(L)[:, None]
        for t in range(n):
            z = p.persistence * z + innov * rng.standard_normal(p.latent_dim)
            logits = base + p.latent_scale * (self.proj @ z) + p.reuse * trace
            token_noise = rng.gumbel(size=(L, E))
            noisy = logits + token_noise
            if p.explore > 0:  # forced one-off picks: a tail that no cache size captures
                noisy += 1e3 * (rng.random((L, E)) < p.explore * k / E)
            top = np.argpartition(-noisy, k - 1, axis=1)[:, :k]
            order = np.argsort(-noisy[rows, top], axis=1, kind="stable")
            ids = top[rows, order]
            out[t] = ids
            if gates is not None:
                guess = (logits + p.gate_share * token_noise
                         + p.gate_noise * gate_rng.gumbel(size=(L, E)))
                gtop = np.argpartition(-guess, g - 1, axis=1)[:, :g]
                gates[t] = gtop[rows, np.argsort(-guess[rows, gtop], axis=1, kind="stable")]
            trace *= p.reuse_decay
            trace[rows, ids] += 1.0
        return out, gates
