"""The hybrid (Qwen3-Next / Qwen3.5) model's decode step in CUDA graphs, from the Triton kernels in kernels/ and
cuBLAS (or skinny_linear) matmuls over the fused projections of `hybrid_model.fuse_weights`. Everything else
(prefill chunks, mixed batches, speculative verification, the MTP head) runs through the eager `HybridModel` on the
same weights, KV pool and state pages; MoE layers run the eager model's fused MoE launches in the graph too.

One graph step, per layer (a graph node each, no host work):

    linear attention   add+RMSNorm | in_proj | conv step (state in place) | gated delta step (gates, L2 norms,
                       delta rule on the state page in place, gated RMSNorm) | out_proj
    full attention     add+RMSNorm | q|gate|k|v proj | q/k RMSNorm + partial rope + K/V store | split-KV decode
                       attention over the slot table, times the output's sigmoid gate | o_proj
    MLP                add+RMSNorm | gate|up | SiLU*up | down
    MoE MLP            add+RMSNorm | router|shared gate | softmax+top-k | align | grouped gate|up+SiLU*up |
                       grouped down | fixed-order combine (kernels.moe; the shared expert is one more pair)

Each row's inputs add its state page to the dense path's (ids, positions, out slots, table rows, lengths);
padding rows use a scratch KV slot and a scratch state page that no request owns."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from backends.common.model.batch import Span, build_batch, past_images, rope_offset
from backends.common.model.decode_graphs import DecodeGraphs
from backends.common.model.decode_graphs import _EagerGraph as _EagerBody
from backends.common.model.hybrid_model import HybridModel
from backends.common.model.kv_store import KVStore, StateStore


def supports(cfg) -> bool:
    """Whether the graph step covers this model: power-of-two head dims (the kernels' tiles), no attention biases.
    MoE layers run kernels.moe's launches (HybridModel._fused_moe), which never wait for the host."""

    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    return pow2(cfg.head_dim) and pow2(int(cfg.head_dim * cfg.partial_rotary_factor)) and not cfg.attention_bias


class _Norm:
    """rmsnorm(a + res) * (1 + w) on the residual stream, not computed yet, so that the projection reading it can
    compute it as it loads (kernels.linear.normed_linear: one launch instead of two). res None: a plain
    norm of a. h: the residual stream after the add, set by whoever computes it (`GpuHybrid._normed` or the
    projection)."""

    __slots__ = ("a", "res", "w", "h")

    def __init__(self, a: torch.Tensor, res: torch.Tensor | None, w: torch.Tensor):
        self.a, self.res, self.w, self.h = a, res, w, None

    @property
    def shape(self):
        return self.a.shape


class GpuHybrid(DecodeGraphs):
    # the inputs a skinny_linear launch can compute as it reads them (kernels.linear.tune's prologues): the layer
    # norms before in_proj / qkv / gate_up, the MLP's silu(gate) * up. The attention output's sigmoid gate is
    # applied as the decode attention stores its output
    PROLOGUES = {"in_proj": "norm", "qkv": "norm", "gate_up": "norm", "down": "silu"}
    # gate_up: or silu(gate) * up after it, at more than one row; out, o, down: their product goes to the add + RMSNorm
    # of the residual stream (in a launch of its own, or in the next projection's where its choice says norm)
    EPILOGUES = {"gate_up": "glu", "out": "norm", "o": "norm", "down": "norm"}

    def __init__(
        self,
        eager: HybridModel,
        kv: KVStore,
        state: StateStore,
        scratch_slot: int,
        pad_page: int,
        max_batch: int = 256,
        max_ctx: int | None = None,
        graph_sizes: tuple[int, ...] | None = (1, 2, 4, 8, 16, 32, 64, 128, 256),
        linear_choice: dict[tuple[str, int], dict] | None = None,
    ):
        """eager: the model whose weights (fused) this shares; scratch_slot: a KV slot and pad_page: a state page
        outside the scheduler's, for padding rows. linear_choice: as for GpuLlama."""
        from kernels import act, attention, delta_rule, delta_tune, linear, norm, rope

        self.k_attn, self.k_norm, self.k_rope, self.k_act, self.k_lin, self.k_dr = (
            attention, norm, rope, act, linear, delta_rule,
        )  # fmt: skip
        self.k_dt = delta_tune
        cfg = eager.cfg
        if not supports(cfg):
            raise ValueError("GpuHybrid: attention biases and non-power-of-two head dims run eagerly")
        if eager.experts and eager.k_moe is None:
            raise ValueError("GpuHybrid: an MoE model needs the eager model built with kernels=True")
        self.eager, self.cfg, self.kv, self.state = eager, cfg, kv, state
        self.device, self.dtype = eager.device, eager.dtype
        self.has_mtp, self.num_kv_layers = eager.has_mtp, eager.num_kv_layers
        self.pad_page = pad_page
        w = eager.w
        self.embed, self.lm_head = w["model.embed_tokens.weight"], eager.lm_head
        self.final_norm = w["model.norm.weight"]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            L = dict(ln1=w[p + "input_layernorm.weight"], ln2=w[p + "post_attention_layernorm.weight"],
                     moe=i in eager.experts, mlp=p + "mlp.")  # fmt: skip
            if not L["moe"]:
                L.update(gate_up=w[p + "mlp.gate_up_proj.weight"], down=w[p + "mlp.down_proj.weight"])
            else:  # the router and shared-expert gate, one projection
                L.update(router=eager.router[i])
            if i in eager.kv_index:
                a = p + "self_attn."
                L.update(full=True, kv_layer=eager.kv_index[i], qkv=w[a + "qkv_proj.weight"], o=w[a + "o_proj.weight"],
                         q_norm=w[a + "q_norm.weight"], k_norm=w[a + "k_norm.weight"])  # fmt: skip
            else:
                a = p + "linear_attn."
                L.update(
                    full=False, j=eager.state_index[i], in_proj=w[a + "in_proj.weight"],
                    conv=w[a + "conv1d.weight"].view(cfg.conv_dim, -1), a_log=w[a + "A_log"].float().contiguous(),
                    dt_bias=w[a + "dt_bias"].float().contiguous(), norm=w[a + "norm.weight"],
                    out=w[a + "out_proj.weight"],
                )  # fmt: skip
            self.layers.append(L)
        self.CONV_CHANNELS = {"in_proj": cfg.conv_dim}  # in_proj's first outputs go through the conv step
        self._init_graphs(max_batch, max_ctx or min(cfg.max_position_embeddings, kv.num_slots), scratch_slot,
                          linear_choice)  # fmt: skip
        self.cos, self.sin = rope.rope_cache(eager.inv_freq, self.max_ctx, self.device)
        # two query rows per sequence in a speculative verification graph
        self.attn_counters = torch.zeros(2 * max_batch * cfg.num_kv_heads, dtype=torch.int32, device=self.device)
        # the delta step's arrival counters: per value head where a head's blocks are shared among programs, then per
        # key head where the step does the conv (`_tune_kernels`)
        self.delta_counters = torch.zeros(
            2 * max_batch * (cfg.linear_num_value_heads + cfg.linear_num_key_heads),
            dtype=torch.int32,
            device=self.device,
        )
        # graph size -> gated_delta_step settings timed fastest here (`_tune_kernels`; absent: step_settings)
        self.delta_choice: dict[int, dict] = {}
        self.delta_times: dict[int, dict] = {}
        self.verify_graphs: dict[int, object] = {}
        self.mtp_graphs: dict[int, object] = {}
        if self.has_mtp:
            m = "mtp.layers.0."
            self.mtp_layer = dict(
                ln1=w[m + "input_layernorm.weight"], ln2=w[m + "post_attention_layernorm.weight"],
                moe="mtp" in eager.experts, mlp=m + "mlp.", kv_layer=eager.mtp_kv_layer,
                qkv=w[m + "self_attn.qkv_proj.weight"], o=w[m + "self_attn.o_proj.weight"],
                q_norm=w[m + "self_attn.q_norm.weight"], k_norm=w[m + "self_attn.k_norm.weight"],
            )  # fmt: skip
            if not self.mtp_layer["moe"]:
                self.mtp_layer.update(gate_up=w[m + "mlp.gate_up_proj.weight"], down=w[m + "mlp.down_proj.weight"])
            else:
                self.mtp_layer.update(router=eager.router["mtp"])
        if graph_sizes:
            self.capture([b for b in graph_sizes if b <= max_batch] or [max_batch])

    # ----- the graph inputs -----
    def pad_column(self) -> np.ndarray:
        """The dense path's five input rows, then each row's state page (padding: the scratch page)."""
        return np.append(super().pad_column(), np.int32(self.pad_page))

    def _fill_inputs(self, h: np.ndarray, spans) -> None:
        super()._fill_inputs(h, spans)
        h[5, : len(spans)] = [s.state_page for s in spans]

    def _graphable(self, spans) -> bool:
        return super()._graphable(spans) and all(
            s.state_page >= 0 and s.save_page < 0 and not s.logits_all for s in spans
        )

    # ----- eager: everything that is not a plain decode batch -----
    def _eager(self, spans) -> torch.Tensor:
        return self.eager.forward(build_batch(spans, self.device), self.kv, self.state)

    # ----- the decode step -----
    def _decode_body(self, bs: int) -> None:
        inp = self.graph_inputs[bs]  # [6, bs] int32: ids, positions, out slots, table rows, lengths, state pages
        ids = self._graph_ids(inp)
        self.table.table.index_put_((inp[3], inp[1]), inp[2])  # each sequence's new slot
        x = self._layers(ids, inp, bs)
        self.graph_logits[:bs].copy_(F.linear(x, self.lm_head).float())
        self._store_tokens(bs, inp)

    def _lin(self, rows: int):
        """The projection function of a graph with `rows` query rows (skinny_linear where tuning chose it, with its
        input computed as it loads where the choice says so). Its attribute glu: gate_up's choice fuses silu(gate) *
        up after the product, so down takes that as its input."""
        names = ("in_proj", "out", "qkv", "o", "gate_up", "down", "router")
        choice = {n: self.linear_choice.get((n, rows)) for n in names}
        if self._norm_fused(rows):
            # a projection computes the norm of out's, o's or down's product as it reads it: that product is added
            # up in its own launch (a `defer` pick, tuned where no norm was fused, would leave its partial sums to
            # the add + RMSNorm launch; `_tune_linear` tunes them after the norm's readers)
            for n, epilogue in self.EPILOGUES.items():
                if epilogue == "norm" and (choice[n] or {}).get("defer"):
                    choice[n] = {k: v for k, v in choice[n].items() if k != "defer"}
        eps = self.cfg.rms_norm_eps

        def lin(x, L, name, gated=False, conv=None):
            c = choice[name]
            if isinstance(x, _Norm):  # the norm in the projection's launch where the choice says norm
                y, x.h = self.k_lin.normed_linear(x.a, x.res, x.w, eps, L[name], c, conv, preload=True)
                return y
            if gated:  # x is [gate | up]: silu(gate) * up goes in
                return self.k_lin.gated_linear(x, L[name], c)
            return self.k_lin.linear(x, L[name], c, conv)

        lin.glu = bool((choice["gate_up"] or {}).get("glu"))  # gate_up's launch gives silu(gate) * up
        return lin

    def _normed(self, x):
        """A pending `_Norm` computed in a launch of its own (kernels.norm); a tensor as it is."""
        if not isinstance(x, _Norm):
            return x
        out = self.k_norm.add_rms_norm(x.a, x.res, x.w, self.cfg.rms_norm_eps, offset=True, preload=True)
        x.h = x.a if x.res is None else x.res  # updated in place
        return out

    def _layers(self, ids, inp, rows: int, halves: int | None = None) -> torch.Tensor:
        """Every layer over `rows` query rows; returns the final-norm hidden states [rows, hidden]. halves: see
        `_linear_attention`."""
        lin = self._lin(rows)
        x = _Norm(F.embedding(ids, self.embed), None, self.layers[0]["ln1"])
        for i, L in enumerate(self.layers):
            if L["full"]:
                a = self._full_attention(x, L, inp, rows, lin)
            else:
                a = self._linear_attention(x, L, inp, lin, halves)
            nxt = self.layers[i + 1]["ln1"] if i + 1 < len(self.layers) else self.final_norm
            x = self._mlp(a, x.h, L, i, lin, nxt)
        return self._normed(x)

    def _mlp(self, a, h, L, key, lin, nxt) -> _Norm:
        """h + a, plus the MLP of its rmsnorm; returns the rmsnorm of that with weight nxt (the next layer's input
        norm), pending (`_Norm`)."""
        x = _Norm(a, h, L["ln2"])
        if L["moe"]:
            m = self.eager.mlp(self._normed(x), L["mlp"], key, router=lambda xn, w: lin(xn, L, "router"))
        elif lin.glu:  # gate_up's launch gave silu(gate) * up (its choice says glu; down was tuned for that)
            m = lin(lin(x, L, "gate_up"), L, "down")
        else:
            m = lin(lin(x, L, "gate_up"), L, "down", gated=True)
        return _Norm(m, x.h, nxt)

    def _linear_attention(self, x, L, inp, lin, halves: int | None = None):
        """The conv and delta-rule step of every row, each on its state page inp[5] in place; with halves (a
        verification graph of that many sequences) rows [0, halves) first, then the drafts' rows, each reading page
        inp[5] and writing page inp[6], so a draft continues from the state its input's row wrote."""
        cfg, j, n = self.cfg, L["j"], x.shape[0]
        conv, ssm = self.state.conv(j), self.state.ssm(j)
        parts = [slice(0, n)] if halves is None else [slice(0, halves), slice(halves, n)]
        writes = [None] * len(parts) if halves is None else [inp[6, p] for p in parts]
        tuned = dict(self.delta_choice.get(n if halves is None else halves) or {})
        core = torch.empty(n, cfg.linear_num_value_heads * cfg.linear_value_head_dim, dtype=L["out"].dtype,
                           device=self.device)  # fmt: skip
        fused = tuned.pop("conv", False) and halves is None  # the conv step in the delta step's launch
        mixed = None if fused else torch.empty(n, cfg.conv_dim, dtype=torch.float32, device=self.device)
        if fused:
            proj = lin(x, L, "in_proj")
        elif halves is None:  # the conv step in the projection's launch where the choice says conv
            proj = lin(x, L, "in_proj", conv=(L["conv"], conv, inp[5], inp[5], mixed))  # [n, conv_dim | z | b | a]
        else:
            proj = lin(x, L, "in_proj")
            for i, (p, w) in enumerate(zip(parts, writes)):  # the drafts' rows read what the launch before wrote
                self.k_dr.conv_step(proj[p], L["conv"], conv, inp[5, p], out=mixed[p], out_pages=w, preload=i == 0)
        for i, (p, w) in enumerate(zip(parts, writes)):  # the drafts' rows read what the launch before wrote
            settings = dict(tuned, preload=i == 0) if tuned else self.k_dr.step_settings(p.stop - p.start, i == 0)
            self.k_dr.gated_delta_step(
                None if fused else mixed[p], proj[p], L["a_log"], L["dt_bias"], L["norm"], ssm, inp[5, p],
                cfg.linear_num_key_heads, cfg.rms_norm_eps, out=core[p], out_pages=w, counters=self.delta_counters,
                conv=(L["conv"], conv) if fused else None, **settings,
            )  # fmt: skip
        return lin(core, L, "out")

    def _full_attention(self, x, L, inp, bs, lin):
        """bs: the number of query rows (inp's columns)."""
        cfg = self.cfg
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kl = L["kv_layer"]
        k_pool, v_pool = self.kv.k(kl), self.kv.v(kl)
        qkv = lin(x, L, "qkv")  # [B, q | gate | k | v]
        q = self.k_rope.qk_norm_rope_store_kv_(
            qkv, H, Hkv, L["q_norm"], L["k_norm"], cfg.rms_norm_eps, inp[1], self.cos, self.sin, k_pool, v_pool,
            inp[2],
        )  # fmt: skip
        gate = qkv[:, H * D : 2 * H * D]  # the output's sigmoid gate, applied as the attention stores its output
        attn = self.k_attn.decode_attention(
            q, k_pool, v_pool, self.table.table, inp[3], inp[4], self.eager.scale, q_idx=self.qidx[:bs],
            counters=self.attn_counters, gate=gate, **self.k_attn.decode_settings(bs, Hkv, D),
        )  # fmt: skip
        return lin(attn.view(-1, H * D), L, "o")

    # ----- speculative verification in graphs -----
    # A verification graph of bs sequences has 2 * bs query rows: column i is sequence i's input token, column
    # bs + i its draft (a padding column where it has none). Its input rows are the decode graph's five, then the
    # state page each column reads and the one it writes: the input token reads the request's page and writes its
    # scratch page (the state after the input: the rollback point), the draft reads that and writes the request's
    # page, so the request's page ends after the draft as in the eager path; without a draft the input token
    # updates its page in place. The MTP graph of bs sequences runs the MTP head over the same 2 * bs columns (the
    # token after each verified position, the verify graph's hidden state there) and takes each row's argmax.
    def capture_speculative(self, mtp: bool = True) -> None:
        """Capture the verification graphs (and with mtp the MTP head's) for every decode graph size."""
        sizes = sorted(self.graphs)
        if not sizes or self.verify_graphs:
            return
        n, dev = 2 * max(sizes), self.device
        V, H = self.cfg.vocab_size, self.cfg.hidden_size
        self._spec_padded = torch.full((n, 128 * self.argmax_chunk), float("-inf"), dtype=torch.float32, device=dev)
        self.spec_logits = self._spec_padded[:, :V]  # the verify graph's logits, then the MTP graph's
        self.spec_hidden = torch.zeros(n, H, dtype=self.dtype, device=dev)
        self.verify_tokens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.mtp_tokens = torch.zeros(n, dtype=torch.int32, device=dev)
        pin = dev.type == "cuda"
        self.spec_host_tok = torch.zeros(2, n, dtype=torch.int32, pin_memory=pin)
        vpad = np.append(self.pad_column(), np.int32(self.pad_page))  # read page, write page
        self._vpad, self._mpad = vpad, self._pad[:5]
        self.verify_inputs = {bs: torch.from_numpy(np.repeat(vpad[:, None], 2 * bs, 1).copy()).to(dev) for bs in sizes}
        self.mtp_inputs = {bs: torch.from_numpy(np.repeat(self._mpad[:, None], 2 * bs, 1).copy()).to(dev)
                           for bs in sizes}  # fmt: skip
        self._spec_host = {bs: torch.zeros(7 + 5, 2 * bs, dtype=torch.int32, pin_memory=pin) for bs in sizes}
        self._spec_event = torch.cuda.Event() if pin else None
        self.stats.update(verify_steps=0, mtp_steps=0)
        bodies = [(self.verify_graphs, self._verify_body)]
        if mtp and self.has_mtp:
            bodies.append((self.mtp_graphs, self._mtp_body))
        if dev.type != "cuda":
            for graphs, body in bodies:
                graphs.update({bs: _EagerBody(body, bs) for bs in sizes})
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in sorted(sizes, reverse=True):
                for graphs, body in bodies:
                    body(bs)  # compiles this size's kernels outside the capture
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self._graph_pool, stream=stream):
                        body(bs)
                    graphs[bs] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def verify_graphable(self, spans) -> bool:
        return (
            bool(self.verify_graphs)
            and self.fits_graph(len(spans))
            and all(
                s.state_page >= 0
                and past_images(s)
                and (len(s.token_ids) == 1 and s.save_page < 0 or len(s.token_ids) == 2 and s.save_page >= 0)
                for s in spans
            )
        )

    @torch.inference_mode()
    def launch_verify(self, spans) -> bool:
        """Replay the verification graph for spans of one token (no draft) or two (input and draft, with a save
        page); False when the batch is not a graph batch (the caller runs the eager path)."""
        if not self.verify_graphable(spans):
            return False
        B = len(spans)
        bs = self.graph_size(B)
        rows, wr, wc, ws = self.table.prepare(spans, skip_last=True)
        if self._spec_event is not None:
            self._spec_event.synchronize()  # the previous step's input copies have run (they have: it was read)
        h = self._spec_host[bs].numpy()
        v = h[:7]
        v[:] = self._vpad[:, None]
        for i, (s, row) in enumerate(zip(spans, rows)):
            n0, d = s.start, rope_offset(s)
            v[:, i] = (s.token_ids[0], n0 + d, s.slots[n0], row, n0 + 1, s.state_page, s.state_page)
            if len(s.token_ids) == 2:
                v[6, i] = s.save_page
                v[:, bs + i] = (s.token_ids[1], n0 + 1 + d, s.slots[n0 + 1], row, n0 + 2, s.save_page, s.state_page)
        self.verify_inputs[bs].copy_(self._spec_host[bs][:7], non_blocking=True)
        if self._spec_event is not None:
            self._spec_event.record()
        if wr:
            self._apply_writes(*self.uploader.upload([wr, wc, ws], self.device))
        self.verify_graphs[bs].replay()
        self.stats["verify_steps"] += 1
        self._spec = (spans, bs, rows)
        return True

    def verify_rows(self) -> list[int]:
        """The launched verification's logits rows in the eager path's order: each span's input, then its draft."""
        spans, bs, _ = self._spec
        return [r for i, s in enumerate(spans) for r in ((i, bs + i) if len(s.token_ids) == 2 else (i,))]

    def verify_logits(self) -> torch.Tensor:
        """float32 logits of the launched verification, rows as `verify_rows`."""
        return self.spec_logits[torch.tensor(self.verify_rows(), device=self.device)]

    def verify_argmax(self) -> list[list[int]]:
        """Per span, the argmax token after its input (and after its draft, for a span with one)."""
        spans, bs, _ = self._spec
        tok = self._read(self.verify_tokens, 2 * bs, 0)
        return [[tok[i], tok[bs + i]] if len(s.token_ids) == 2 else [tok[i]] for i, s in enumerate(spans)]

    @torch.inference_mode()
    def launch_mtp(self, nexts: list[list[int] | None] | None = None) -> None:
        """The MTP head over the launched verification's columns. nexts[i]: the tokens sequence i sampled after
        its input (and after its draft, when kept), or None to skip the sequence; nexts None: every row takes the
        verification's own argmax (a greedy batch, launched before the verification is read)."""
        spans, bs, rows = self._spec
        h = self._spec_host[bs].numpy()
        m = h[7:]
        m[:] = self._mpad[:, None]
        for i, (s, row) in enumerate(zip(spans, rows)):
            nx = [-1, -1] if nexts is None else nexts[i]
            if nx is None:
                continue
            n0, d = s.start, rope_offset(s)
            m[:, i] = (nx[0], n0 + d, s.slots[n0], row, n0 + 1)
            if len(nx) == 2 and len(s.token_ids) == 2:
                m[:, bs + i] = (nx[1], n0 + 1 + d, s.slots[n0 + 1], row, n0 + 2)
        self.mtp_inputs[bs].copy_(self._spec_host[bs][7:], non_blocking=True)
        if self._spec_event is not None:
            self._spec_event.record()
        self.mtp_graphs[bs].replay()
        self.stats["mtp_steps"] += 1

    def mtp_drafts(self, kept: list[bool]) -> list[int]:
        """Per span, the MTP head's draft for the token after next: from its draft's column where kept[i]."""
        spans, bs, _ = self._spec
        tok = self._read(self.mtp_tokens, 2 * bs, 1)
        return [tok[bs + i] if k else tok[i] for i, k in enumerate(kept)]

    def _read(self, dev_tokens: torch.Tensor, n: int, which: int) -> list[int]:
        host = self.spec_host_tok[which, :n]
        host.copy_(dev_tokens[:n], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return host.tolist()

    def _verify_body(self, bs: int) -> None:
        inp = self.verify_inputs[bs]  # [7, 2 bs]: the decode graph's five rows, read pages, write pages
        R = 2 * bs
        self.table.table.index_put_((inp[3], inp[1]), inp[2])
        x = self._layers(inp[0], inp, R, halves=bs)
        self.spec_hidden[:R].copy_(x)
        self.spec_logits[:R].copy_(F.linear(x, self.lm_head).float())
        self.verify_tokens[:R].copy_(self._argmax(R, self._spec_padded))

    def _mtp_body(self, bs: int) -> None:
        inp = self.mtp_inputs[bs]  # [5, 2 bs]: ids (-1: the verification's argmax), positions, slots, rows, lengths
        R = 2 * bs
        cfg, w, L = self.cfg, self.eager.w, self.mtp_layer
        eps, norm, lin = cfg.rms_norm_eps, self.k_norm.add_rms_norm, self._lin(R)
        ids = torch.where(inp[0] >= 0, inp[0], self.verify_tokens[:R])
        e = norm(F.embedding(ids, self.embed), None, w["mtp.pre_fc_norm_embedding.weight"], eps, offset=True)
        hid = norm(self.spec_hidden[:R], None, w["mtp.pre_fc_norm_hidden.weight"], eps, offset=True)
        h = F.linear(torch.cat((e, hid), dim=-1), w["mtp.fc.weight"])
        x = norm(h, None, L["ln1"], eps, offset=True)
        a = self._full_attention(x, L, inp, R, lin)
        x = self._normed(self._mlp(a, h, L, "mtp", lin, w["mtp.norm.weight"]))
        self.spec_logits[:R].copy_(F.linear(x, self.lm_head).float())
        self.mtp_tokens[:R].copy_(self._argmax(R, self._spec_padded))

    # ----- capture -----
    def _tune_kernels(self, sizes: list[int]) -> None:
        """For each graph size, the gated delta step's settings that ran fastest here (kernels.delta_tune.tune_step),
        with the conv step in the delta step's launch as a candidate: where in_proj's choice leaves the conv to a
        launch of its own, against that launch; where in_proj's choice does the conv, against in_proj timed
        without it (kernels.linear.tune with no conv channels, whose pick in_proj then takes if the conv moves).
        Kept in `delta_choice` (the plain decode graphs take the pick, the verification graphs its settings without
        the conv); a size whose tuning fails (out of memory for the state copies) keeps `step_settings`, with one
        warning. One progress line on stderr."""
        cfg = self.cfg
        shape = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                 cfg.linear_value_head_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim)  # fmt: skip
        linear = [L for L in self.layers if not L["full"]]
        if not linear:
            return
        cache = self.k_dt.step_tune_cache()
        hits, t0 = cache.hits, time.perf_counter()
        dtype = linear[0]["out"].dtype
        for bs in sizes:
            pick = self.linear_choice.get(("in_proj", bs))
            fused, saving, alt = bool((pick or {}).get("conv")), 0.0, None
            try:
                if fused:  # in_proj's launch does the conv: what it costs there
                    t_fused = self.linear_times[("in_proj", bs)].get(str(pick))
                    alt, alt_times = self.k_lin.tune([L["in_proj"] for L in linear], bs, self.PROLOGUES.get("in_proj"))
                    t_alt = alt_times.get(str(alt) if alt is not None else "cublas")
                    if isinstance(t_fused, float) and isinstance(t_alt, float):
                        saving = t_fused - t_alt
                tuned = self.k_dt.tune_step(shape, bs, len(linear), dtype, self.device, not fused, saving)
                choice, self.delta_times[bs] = tuned
            except torch.cuda.OutOfMemoryError as e:
                print(f"[triton-pd] decode graphs: delta step not tuned for {bs} rows ({e!r:.120}): defaults",
                      file=sys.stderr, flush=True)  # fmt: skip
                torch.cuda.empty_cache()
                continue
            if choice is None:
                continue
            self.delta_choice[bs] = choice
            if fused and choice.get("conv"):  # the conv moves out of in_proj's launch
                if alt is None:
                    self.linear_choice.pop(("in_proj", bs), None)
                else:
                    self.linear_choice[("in_proj", bs)] = alt
        took = time.perf_counter() - t0
        cached = f", {cache.hits - hits} of them from {cache.path}" if cache.path else ""
        print(f"[triton-pd] decode graphs: delta step tuned for {len(sizes)} sizes ({took:.0f} s{cached})",
              file=sys.stderr, flush=True)  # fmt: skip

    def _tune_groups(self) -> dict[str, list[torch.Tensor]]:
        full = [L for L in self.layers if L["full"]]
        lin = [L for L in self.layers if not L["full"]]
        dense = [L for L in self.layers if not L["moe"]]
        moe = [L for L in self.layers if L["moe"]]
        # the norm's readers first (out, o and down are tuned knowing whether a norm launch reads their product)
        groups = {"in_proj": lin, "qkv": full, "gate_up": dense, "out": lin, "o": full, "down": dense,
                  "router": moe}  # fmt: skip
        return {name: [L[name] for L in ls] for name, ls in groups.items() if ls}

    def _after_capture(self) -> None:
        """Compile the eager path's kernels (a prefill chunk, decode rows) before the first request needs them. The
        slots written are free (nothing is cached yet) and the state page is the padding rows' scratch page."""
        if self.kv.num_slots < 256:
            return
        V, pg = self.cfg.vocab_size, self.pad_page
        ids = [i % V for i in range(64)]
        for spans in (
            [Span(ids[:40], 0, list(range(40)), None, pg)],
            [Span(ids[:1], 5, list(range(100, 106)), None, pg), Span(ids[:1], 9, list(range(110, 120)), None, pg)],
        ):
            self._eager(spans)
        torch.cuda.synchronize()
