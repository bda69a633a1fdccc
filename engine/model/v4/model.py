"""The DeepSeek-V4 model, written against the paper's notation.

Parameter names are the official checkpoint names, so a state_dict maps one to one onto a
checkpoint. Shapes in comments: T = tokens in the flattened batch, D = hidden size,
hc = residual streams. The attention (window, CSA, HCA, compressors, indexer) is in
`engine/model/v4/attention.py` (compressors and the indexer in `compressor.py`).

The forward pass takes a flattened batch of new tokens from several sequences plus an
`AttentionMetadata` describing each sequence (its State Cache slot, block table, start
position); all KV is read from and written to a `DeviceKV`.

`DeepseekV4(cfg, parallel)` builds one rank's shard under tensor/expert parallelism
(engine/model/parallel/sharding.py says which weights split and how the parts are summed); without it, or at
size 1, the modules and the computation are exactly the single-process ones.
"""

from __future__ import annotations

import torch
from torch import nn

from v4serve.cache.device_kv import DeviceKV, LayerKV
from v4serve.engine.model.config import ModelConfig
from v4serve.engine.model.layers import RMSNorm, Rotary
from v4serve.engine.model.metadata import AttentionMetadata, StepAbilities
from v4serve.engine.model.moe import MoE
from v4serve.engine.model.parallel.sharding import ParallelConfig, embed_shard, gather_vocab, local
from v4serve.engine.model.v4.attention import Attention
from v4serve.engine.model.weights.packed import weight_of
from v4serve.engine.model.weights.resident import held_in_fp32
from v4serve.kernels.attention import RaggedBatch, upload
from v4serve.kernels.norm_rope import rms_norm
from v4serve.kernels.registry import Kernels, load_kernels

# torch.mm(..., out_dtype=): a half-precision GEMM written in fp32 (CUDA, torch 2.8 on).
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")

class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.kernels = load_kernels("torch")
        self.attn = Attention(cfg, layer, parallel)
        self.ffn = MoE(cfg, layer, parallel)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, hc * cfg.hidden_size)))
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))

    def _mixed(self, h: torch.Tensor, part: str, norm: RMSNorm, sublayer) -> torch.Tensor:
        """mHC around a sublayer (kernels/mhc.py), whose input norm is fused into the pre step:
        h [T, hc, D] → [T, hc, D]."""
        cfg, k = self.cfg, self.kernels
        x, post, comb = k.mhc_pre(h, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_base"),
                                  getattr(self, f"hc_{part}_scale"), cfg.hc_eps, cfg.rms_norm_eps,
                                  cfg.hc_sinkhorn_iters, norm.weight)
        return k.mhc_post(h, sublayer(x), post, comb)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                batch: RaggedBatch, layer_kv: LayerKV, rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor
                ) -> torch.Tensor:
        h = self._mixed(h, "attn", self.attn_norm,
                        lambda x: self.attn(x, meta, batch, layer_kv, rotary, cos, sin, positions))
        return self._mixed(h, "ffn", self.ffn_norm, lambda x: self.ffn(x, input_ids))


class MTPBlock(Block):
    """A multi-token-prediction layer (`mtp.k.*`): from the main model's last state at position p (its
    streams before the head) and the embedding of token p+1, a window-only block whose output, through
    its own mHC head and norm and the shared head, guesses token p+2. Its output state stands in for
    the main model's at the next position, so the same layer guesses further ahead (recursive drafts)."""

    def __init__(self, cfg: ModelConfig, index: int, parallel: ParallelConfig | None = None) -> None:
        super().__init__(cfg, cfg.num_layers + index, parallel)
        d, hc = cfg.hidden_size, cfg.hc_mult
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * d))
        self.hc_head_base = nn.Parameter(torch.zeros(hc))
        self.hc_head_scale = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor, e: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                meta: AttentionMetadata, batch: RaggedBatch, layer_kv: LayerKV, rotary: Rotary, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """h [T, hc, D] the main state at each row's position, e [T, D] the embedding of the token after
        it (`next_ids` [T]) → the layer's output state [T, hc, D]."""
        k, t, hc, d = self.kernels, h.shape[0], h.shape[1], h.shape[2]
        x = k.linear(self.hnorm(h).reshape(t * hc, d), weight_of(self.h_proj)).view(t, hc, d)
        x = x + k.linear(self.enorm(e), weight_of(self.e_proj)).unsqueeze(1)
        return super().forward(x, next_ids, positions, meta, batch, layer_kv, rotary, cos, sin)


class DeepseekV4(nn.Module):
    family = "v4"
    context_tokens = 0  # tokens before each chunk a step reads (V4 reads its KV alone)
    abilities = StepAbilities()

    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig | None = None, mtp_layers: int = 0) -> None:
        """`mtp_layers`: how many of the checkpoint's multi-token-prediction layers to build (for
        speculative decoding; they read the last KV layers of the `DeviceKV`)."""
        super().__init__()
        if parallel is not None:
            parallel.check(cfg)
        self.cfg = cfg
        self.parallel = local(parallel)
        # Vocabulary rows of the embedding and head this rank holds (all of them in one process).
        self.vocab_rows = self.parallel.span(cfg.vocab_size) if self.parallel else (0, cfg.vocab_size)
        rows = self.vocab_rows[1] - self.vocab_rows[0]
        # Its own weight, so nn.Embedding skips its random init: `normal_` on the meta device the
        # loader builds on would import torch._dynamo (~2.5 s of CPU at every engine and rank start).
        self.embed = nn.Embedding(rows, cfg.hidden_size, _weight=torch.empty(rows, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i, self.parallel) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, rows, bias=False)
        self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        # Window-only layers rotate with plain RoPE; compressed layers (and their compressors
        # and indexers) with the YaRN-scaled compress theta.
        self.rotary_main = Rotary(cfg.rope_dim, cfg.rope_theta, None)
        self.rotary_compress = Rotary(cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn)
        self.kernels = load_kernels("torch")
        self.mtp = nn.ModuleList(MTPBlock(cfg, k, self.parallel) for k in range(mtp_layers))

    def in_dtype(self, dtype: torch.dtype) -> DeepseekV4:
        """Cast to `dtype`, but for the parameters `held_in_fp32` names (engine/model/weights/resident.py),
        which stay fp32 so no step casts them again."""
        self.to(dtype)
        for name, param in self.named_parameters():
            if held_in_fp32(name):
                param.data = param.data.float()
        return self

    def use_kernels(self, kernels: Kernels) -> None:
        """Switch every module that calls kernels (each has a `kernels` attribute) to a kernel set
        (kernels/registry.py), and run the projections that share an input as one GEMM
        (`SharedInput`): call it once the model is loaded and on its device."""
        for block in self.layers:
            block.attn.fuse_projections()
        device = self.head.weight.device
        self.rotary_main.place(device)
        self.rotary_compress.place(device)
        for module in self.modules():
            if isinstance(getattr(module, "kernels", None), Kernels):
                module.kernels = kernels

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: DeviceKV,
                batch: RaggedBatch | None = None) -> torch.Tensor:
        """input_ids [T] (the new tokens of every sequence, flattened) → logits [R, V] for
        `meta.logits_rows` (fp32). `batch`: `meta` as tensors, when the caller keeps them (a
        captured step reads its metadata from buffers it owns)."""
        return self.forward_states(input_ids, meta, kv, batch)[0]

    @torch.inference_mode()
    def forward_states(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: DeviceKV,
                       batch: RaggedBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the last state of every row before the head, h [T, hc, D] (what the
        multi-token-prediction layer reads)."""
        batch = batch if batch is not None else meta.ragged(input_ids.device)
        batch.forget_derived()
        positions = batch.row_pos
        cs_main = self.rotary_main.cos_sin(positions)
        cs_comp = self.rotary_compress.cos_sin(positions)
        h = self._embed(input_ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for block, layer_kv in zip(self.layers, kv.layers[:len(self.layers)], strict=True):
            rotary, (cos, sin) = ((self.rotary_main, cs_main) if block.attn.kind == "swa"
                                  else (self.rotary_compress, cs_comp))
            h = block(h, input_ids, positions, meta, batch, layer_kv, rotary, cos, sin)
        return self._logits(self._logit_rows(h, meta.logits_rows), self), h

    @torch.inference_mode()
    def forward_mtp(self, h: torch.Tensor, next_ids: torch.Tensor, meta: AttentionMetadata, kv: DeviceKV,
                    batch: RaggedBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first multi-token-prediction layer over rows of known states: h [T, hc, D] the state at
        each row's position (`meta`'s positions), next_ids [T] the token after each → logits [R, V] of
        the token after that for `meta.logits_rows`, and the layer's output state [T, hc, D]. It reads
        and writes its own window rows (the first KV layer past the main ones)."""
        block = self.mtp[0]
        batch = batch if batch is not None else meta.ragged(next_ids.device)
        batch.forget_derived()
        cos, sin = self.rotary_main.cos_sin(batch.row_pos)  # a window-only layer: plain RoPE
        out = block(h, self._embed(next_ids), next_ids, batch.row_pos, meta, batch, kv.layers[len(self.layers)],
                    self.rotary_main, cos, sin)
        return self._logits(self._logit_rows(out, meta.logits_rows), block), out

    def _logits(self, h: torch.Tensor, owner: nn.Module) -> torch.Tensor:
        """h [R, hc, D] → logits [R, V] through `owner`'s mHC head and final norm (the model's, or an
        MTP layer's) and the shared head."""
        x = owner.norm(self._hc_head(h, owner))
        w = self.head.weight
        if w.is_cuda and x.dtype == w.dtype != torch.float32 and _MM_OUT_DTYPE and not self.kernels.batch_invariant:
            # The weights read as stored, products accumulated and written in fp32: what casting them to
            # fp32 gives (x is in their dtype already: nothing is rounded) without the cast, ~0.4 ms a
            # step at 32K x 4096 on an H200 (a CPU has no such GEMM).
            logits = torch.mm(x, w.t(), out_dtype=torch.float32)  # [R, V] (this rank's V_r)
        else:
            logits = self.kernels.linear(x.float(), w.float())
        if self.parallel is None:
            return logits
        return gather_vocab(logits, self.cfg.vocab_size, -(-self.cfg.vocab_size // self.parallel.size))

    @staticmethod
    def _logit_rows(h: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The rows whose logits are wanted: all of them in a decode step (no copy, no index); else
        an index uploaded without blocking (a list index would be copied up blocking)."""
        if rows == list(range(h.shape[0])):
            return h
        return h.index_select(0, upload(rows, h.device))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] → [T, D]; a rank holds some vocabulary rows: the lookup is summed over the ranks."""
        if self.parallel is None:
            return self.embed(input_ids)
        return embed_shard(input_ids, self.embed.weight, self.vocab_rows[0])

    def _hc_head(self, h: torch.Tensor, owner: nn.Module) -> torch.Tensor:
        eps = self.cfg.hc_eps
        mixes = self.kernels.linear(rms_norm(h.flatten(1).float(), None, self.cfg.rms_norm_eps),
                                    owner.hc_head_fn.float())
        scaled = mixes * owner.hc_head_scale.float() + owner.hc_head_base.float()
        pre = self.kernels.rowwise(torch.sigmoid, scaled) + eps
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
