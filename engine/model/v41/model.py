"""The DeepSeek-V4.1 text model, written against the V4.1 report's notation.

Parameter names are the official checkpoint names, so a state dict maps one to one onto a
checkpoint. What differs from V4 (engine/model/v4/): CSA2 attention (v41/attention.py), Engram
(v41/engram.py) and single-pass mHC: each sublayer's coefficients give its own output gates and
stream mix, and the input gates of the sublayer after it, so a sublayer reads its streams through
the gates the previous one computed (the first through stream 0 alone, the head through the
last). The MoE, RoPE/YaRN and the Sinkhorn projection are V4's.

Shapes: n = new tokens of the sequence, hc = residual streams, D = hidden size, V = vocabulary.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from v4serve.cache.device_kv import DeviceKV
from v4serve.engine.model.layers import RMSNorm, Rotary
from v4serve.engine.model.metadata import AttentionMetadata, StepAbilities
from v4serve.engine.model.moe import MoE
from v4serve.engine.model.v41 import paged
from v4serve.engine.model.v41.attention import Attention, Pick, SequenceKV
from v4serve.engine.model.v41.config import V41Config
from v4serve.engine.model.v41.engram import Engram, NgramHash
from v4serve.kernels.mhc import collapse, mhc_coefficients, mhc_post
from v4serve.kernels.registry import Kernels, load_kernels

log = logging.getLogger(__name__)


class Block(nn.Module):
    def __init__(self, cfg: V41Config, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn = Attention(cfg, layer)
        # V4's experts and router, with the second bias image tokens route by (unused by text).
        self.ffn = MoE(cfg, layer, image_bias=True)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.engram = Engram(cfg, layer) if layer in cfg.engram_layers else None
        hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, hc * cfg.hidden_size)))
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))

    def _gates(self, h: torch.Tensor, part: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return mhc_coefficients(h, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_base"),
                                getattr(self, f"hc_{part}_scale"), cfg.hc_eps, cfg.rms_norm_eps,
                                cfg.hc_sinkhorn_iters)

    def forward(self, h: torch.Tensor, pre: torch.Tensor, input_ids: torch.Tensor, engram_rows: torch.Tensor | None,
                kv: SequenceKV, pick: Pick, rotary: Rotary, cos_sin: tuple[torch.Tensor, torch.Tensor],
                start: int, ring: bool = True) -> tuple[torch.Tensor, torch.Tensor, Pick]:
        """h [n, hc, D] (tokens from position `start`), pre [n, hc] (the input gates the previous sublayer
        computed) → the streams, the next block's input gates and the pick for the next layer."""
        if self.engram is not None:
            assert engram_rows is not None
            h = self.engram(h, engram_rows)
        attn_pre, post, comb = self._gates(h, "attn")
        y, pick = self.attn(self.attn_norm(collapse(h, pre)), kv, pick, rotary, cos_sin, start, ring)
        h = mhc_post(h, y, post, comb)
        ffn_pre, post, comb = self._gates(h, "ffn")
        h = mhc_post(h, self.ffn(self.ffn_norm(collapse(h, attn_pre)), input_ids), post, comb)
        return h, ffn_pre, pick


class DeepseekV41(nn.Module):
    family = "v4.1"
    # Its step runs in plain torch, one sequence at a time, through a dense view of its cache that is written
    # back whole (paged.py): these come with the batched kernels.
    abilities = StepAbilities(
        graphs="DeepSeek-V4.1 steps run in plain torch: no captured decode step yet",
        speculation="speculative decoding is not available for DeepSeek-V4.1 yet (its drafter is DSpark, which "
                    "v4serve does not run yet): leave out --speculative-config",
        parallel="DeepSeek-V4.1 runs on one rank for now: --tensor-parallel-size 1",
        batch_invariant="--batch-invariant is not available for DeepSeek-V4.1 yet (its step has no per-row "
                        "kernels): leave it out",
        fp8_keys="--kv-cache-dtype fp8: DeepSeek-V4.1 keeps its KV rounded as the released model stores it (an "
                 "FP8 window, NVFP4 entries, MXFP4 indexer keys) already; use auto",
        captures_rows=False)
    parallel = None
    mtp: tuple[nn.Module, ...] = ()
    # Layers past the last KV source run on a prefill chunk's tail alone (`row_cuts`); off only to measure it.
    late_layers_on_tail = True

    def __init__(self, cfg: V41Config, token_map: list[int] | None = None) -> None:
        """`token_map`: the tokenizer's Engram map (`server.text.engram_map.folded_token_ids`), needed when the
        model has Engram layers."""
        super().__init__()
        self.cfg = cfg
        self.kernels: Kernels | None = None  # the set the server chose: named in /version, not yet called
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary_main = Rotary(cfg.rope_dim, cfg.rope_theta, None)
        self.rotary_compress = Rotary(cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn)
        if cfg.engram_layers and token_map is None:
            raise ValueError("a V4.1 model with Engram layers needs its tokenizer's Engram map")
        self.ngram = NgramHash(cfg, token_map) if cfg.engram_layers and token_map is not None else None

    @property
    def context_tokens(self) -> int:
        """Tokens before each chunk the step reads (`SeqChunk.history`): the Engram's n-grams reach back."""
        return self.cfg.engram_max_ngram - 1 if self.cfg.engram_layers else 0

    def use_kernels(self, kernels: Kernels) -> None:
        """The step computes in plain torch whatever backend was asked for (V4.1's Triton kernels are not
        written yet): the set kept is the torch one, so /version and the log say what runs."""
        for rotary in (self.rotary_main, self.rotary_compress):
            rotary.place(self.head.weight.device)
        if kernels.backend != "torch":
            log.info("DeepSeek-V4.1: its steps run in plain torch (no %s kernels for it yet)", kernels.backend)
        self.kernels = load_kernels("torch", batch_invariant=kernels.batch_invariant)

    def new_sequence(self) -> SequenceKV:
        return SequenceKV.empty(self.cfg, self.head.weight.device, self.head.weight.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, device_kv: DeviceKV) -> torch.Tensor:
        """The engine's step: every sequence's new tokens, one after another ([T]), their KV in the State
        and Block Cache → logits [len(meta.logits_rows), V] (fp32). Each sequence is run on its own,
        through a dense view of its cache (v41/paged.py) that is written back after."""
        assert meta.capture is None, "V4.1 chunks end on snapshot points (CacheConfig.snapshots_inside_chunks)"
        rows = []
        for seq in meta.seqs:
            new = input_ids[seq.offset:seq.offset + seq.num_new]
            history = torch.cat([torch.tensor(seq.history, dtype=torch.long, device=new.device), new])
            wanted = [r - seq.offset for r in meta.logits_rows if seq.offset <= r < seq.offset + seq.num_new]
            kv = paged.gather(self.cfg, device_kv, seq)
            x, first = self.hidden(history, seq.num_new, kv, min(wanted, default=seq.num_new))
            paged.scatter(self.cfg, device_kv, seq, kv)
            rows.append(x[[r - first for r in wanted]])
        return self.logits(torch.cat(rows))

    def run_sequence(self, history: torch.Tensor, num_new: int, kv: SequenceKV) -> torch.Tensor:
        """One sequence in private dense KV: history [P + n] (its next n tokens, preceded by up to N − 1
        earlier ones) → logits [n, V] (fp32); `kv` advances by n."""
        with torch.inference_mode():
            return self.logits(self.hidden(history, num_new, kv)[0])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head's input [n, D] → fp32 logits [n, V]."""
        return torch.nn.functional.linear(x.float(), self.head.weight.float())

    def row_cuts(self, num_new: int, first_needed: int) -> list[int]:
        """Per layer, how many of a step's leading rows it skips. A layer past the last KV source owns no
        entries: of its rows only those matter whose outputs reach a wanted row (from `first_needed` on) or
        whose keys the next step's window reads (the last W − 1), and each layer below them must be exact
        W − 1 rows further back (the window reaches that far into the layer below). So a long prefill runs
        those layers on its tail alone, exactly."""
        w, last, layers = self.cfg.window - 1, max(self.cfg.kv_source_layers), self.cfg.num_layers
        top = min(first_needed, num_new - w) if self.late_layers_on_tail else 0
        return [max(0, top - (layers - layer) * w) if layer > last else 0 for layer in range(layers)]

    def hidden(self, history: torch.Tensor, num_new: int, kv: SequenceKV, first_needed: int = 0
               ) -> tuple[torch.Tensor, int]:
        """history [P + n]: the sequence's next n tokens, preceded by up to N − 1 earlier ones (the
        Engram's n-grams reach back that far) → the head's input for rows [c, n) and c, where rows before
        `first_needed` are not wanted (`row_cuts`); `kv` advances by n."""
        input_ids = history[history.shape[0] - num_new:]
        positions = torch.arange(kv.length, kv.length + num_new, device=input_ids.device)
        main = self.rotary_main.cos_sin(positions)
        compress = self.rotary_compress.cos_sin(positions)
        rows = self.ngram.rows(history, num_new) if self.ngram is not None else None  # [n, L, K]
        e = self.embed(input_ids)  # [n, D]
        h = e.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [n, hc, D]
        pre = torch.zeros(num_new, self.cfg.hc_mult, device=e.device)
        pre[:, 0] = 1  # the first sublayer reads stream 0: the embedding
        pick, done = Pick(), 0
        for block, cut in zip(self.layers, self.row_cuts(num_new, first_needed), strict=True):
            if cut > done:  # rows [done, cut) matter no more
                drop = cut - done
                h, pre, input_ids, pick = h[drop:], pre[drop:], input_ids[drop:], pick.after(drop)
                rows = rows[drop:] if rows is not None else None
                main, compress = (main[0][drop:], main[1][drop:]), (compress[0][drop:], compress[1][drop:])
                done = cut
            own_rows = rows[:, block.engram.slot] if block.engram is not None and rows is not None else None
            rotary, cos_sin = ((self.rotary_compress, compress) if block.attn.ratio
                               else (self.rotary_main, main))
            h, pre, pick = block(h, pre, input_ids, own_rows, kv, pick, rotary, cos_sin, kv.length + done, done == 0)
        kv.length += num_new
        return self.norm(collapse(h, pre)), done
