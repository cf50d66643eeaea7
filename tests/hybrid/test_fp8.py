"""Fine-grained FP8 checkpoints (backends/common/model/fp8.py) on the CPU path: the block scheme itself, tiny
checkpoints written in the published layout (Llama, Qwen3-Next, Qwen3.5 dense and MoE) against transformers'
own models whose projections run a W8A8 reference written here (per column block, from the checkpoint's block
scales), and the refusals."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from backends.common.core.request import SamplingParams
from backends.common.model import fp8, loader
from backends.common.model.loader import ModelError, load_config, load_weights, resolve
from tests.hybrid.conftest import make_engine, prompt

E4M3 = torch.float8_e4m3fn
# what Qwen's FP8 checkpoints convert (their modules_to_not_convert keeps the rest: norms, embeddings, LM head,
# routers, in_proj_a/b/ba, the conv)
PUBLISHED = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_qkv", "in_proj_z", "out_proj",
             "gate_proj", "up_proj", "down_proj")  # fmt: skip


# ---- the reference: W8A8 per column block, from the block scales -------------------------------------------------
def ref_w8a8(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """x [T, K] (any float) times the checkpoint's e4m3 weight q [N, K] with scale_inv [N / bn, K / bk]: for
    each column block, the activations quantized per token to e4m3 (amax / 448), the block's product scaled."""
    bn, bk = block
    T, K = x.shape
    N = q.shape[0]
    row_scale = scale_inv.double()[torch.arange(N) // bn]  # [N, K / bk]
    y = torch.zeros(T, N, dtype=torch.float64)
    for b in range(math.ceil(K / bk)):
        cols = slice(b * bk, min(K, (b + 1) * bk))
        xb = x[:, cols].double()
        sx = xb.abs().amax(-1).clamp(min=1e-10) / 448.0
        qx = (xb / sx[:, None]).clamp(-448, 448).to(E4M3).double()
        y += (qx @ q[:, cols].double().t()) * sx[:, None] * row_scale[None, :, b]
    return y


def write_fp8(src, dst, block, moe_experts: int = 0):
    """dst: the checkpoint in src converted as Qwen publishes FP8: the `PUBLISHED` projections in e4m3 with
    `weight_scale_inv` per block (fused 3-D experts split into per-expert matrices first), the rest as is, and
    config.json's quantization_config."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    out = {}
    for f in sorted(dst.glob("*.safetensors")):
        out.update(load_file(str(f)))
        f.unlink()
    for name in [n for n in out if n.endswith("experts.gate_up_proj")]:
        base = name[: -len("gate_up_proj")]
        gu, down = out.pop(name), out.pop(base + "down_proj")
        inter = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            out[f"{base}{e}.gate_proj.weight"] = gu[e, :inter].contiguous()
            out[f"{base}{e}.up_proj.weight"] = gu[e, inter:].contiguous()
            out[f"{base}{e}.down_proj.weight"] = down[e].contiguous()
    for name in list(out):
        if name.endswith(tuple(p + ".weight" for p in PUBLISHED)) and "visual" not in name:
            q, s = fp8.quantize_blocks(out[name], block)
            out[name], out[name + "_scale_inv"] = q, s
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg))
    return out


def w8a8_reference(hf, tensors: dict, block):
    """transformers' model with every converted projection computing `ref_w8a8` from the checkpoint's tensors
    (the MoE experts too, one expert at a time)."""
    names = {n.removeprefix("model.language_model.").removeprefix("model."): n for n in tensors}

    def find(module_name):
        return names.get(module_name.removeprefix("model.language_model.").removeprefix("model."))

    for mname, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear) and (key := find(mname + ".weight")) and key + "_scale_inv" in tensors:
            q, s = tensors[key], tensors[key + "_scale_inv"]
            mod.forward = lambda x, q=q, s=s, b=mod.bias: (
                ref_w8a8(x.reshape(-1, x.shape[-1]), q, s, block).view(*x.shape[:-1], -1) + (0 if b is None else b)
            ).to(x.dtype)
        elif type(mod).__name__.endswith("Experts"):
            key = find(mname + ".0.gate_proj.weight")
            base = key[: -len("0.gate_proj.weight")]

            def experts(h, top_i, top_w, base=base):
                out = torch.zeros_like(h)
                for e in top_i.unique().tolist():
                    tok, slot = torch.where(top_i == e)

                    def lin(x, p, e=e):
                        n = f"{base}{e}.{p}.weight"
                        return ref_w8a8(x, tensors[n], tensors[n + "_scale_inv"], block).to(x.dtype)

                    a = F.silu(lin(h[tok], "gate_proj")) * lin(h[tok], "up_proj")
                    out.index_add_(0, tok, lin(a, "down_proj") * top_w[tok, slot, None])
                return out

            mod.forward = experts
    return hf


# ---- the scheme --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (7, 5)])
def test_blocks_round_trip_within_e4m3_precision(shape):
    w = torch.randn(*shape) * torch.logspace(-3, 1, shape[1])[None, :]  # blocks of very different magnitudes
    q, s = fp8.quantize_blocks(w)
    assert q.dtype == E4M3 and s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    back = fp8.from_blocks("w", q, s, fp8.BLOCK).dequantize()
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value; below 2^-6 x scale the steps are fixed
    row_scale = s[torch.arange(shape[0]) // 128].repeat_interleave(128, dim=1)[:, : shape[1]]
    assert ((back - w).abs() <= w.abs() / 16 + row_scale * 2**-9 + 1e-12).all()
    assert (q.float().abs().amax() <= 448) and (q.float().abs() == 448).any()  # each block's amax maps to 448


@pytest.mark.parametrize("block", [(128, 128), (32, 16)])
def test_linear_equals_the_block_reference(block):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 200, generator=g) * 3
    w = torch.randn(150, 200, generator=g) * 0.05
    q, s = fp8.quantize_blocks(w, block)
    ours = fp8.linear(x, fp8.from_blocks("w", q, s, block))
    ref = ref_w8a8(x, q, s, block)
    assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    # and it is W8A8, not the 16-bit product: the activations' rounding shows
    assert (ours - x @ w.t()).abs().max().item() > 1e-3


def test_fused_rows_and_stacked_experts_equal_their_parts():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g)
    a, b = (fp8.quantize(torch.randn(n, 64, generator=g), (32, 32)) for n in (48, 40))
    plain = torch.randn(8, 64, generator=g)
    fused = fp8.cat_rows([a, b, plain])  # FP8 rows, then 16-bit rows
    assert isinstance(fused, fp8.RowParts) and fused.shape == (96, 64)
    want = torch.cat([fp8.linear(x, a), fp8.linear(x, b), x @ plain.t()], dim=-1)
    assert torch.equal(fp8.linear(x, fused), want)
    perm = torch.randperm(48, generator=g)
    assert torch.equal(fp8.linear(x, fp8.take_rows(a, perm)), fp8.linear(x, a)[:, perm])
    stacked = fp8.stack([a, fp8.take_rows(a, perm)])
    assert torch.equal(fp8.linear(x, stacked[1]), fp8.linear(x, a)[:, perm])


# ---- checkpoints in the published layout -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_fp8(tmp_path_factory):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    hf = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    src = tmp_path_factory.mktemp("llama") / "bf"
    hf.save_pretrained(src)
    return src, src.parent / "fp8"


def _checkpoint(request, tmp_path_factory, kind):
    """(fp8 folder, transformers reference, block) of a tiny checkpoint of `kind`, written in the published
    layout with 32 x 32 blocks (so that every matrix has several)."""
    from transformers import AutoModelForCausalLM

    block = (32, 32)
    # the reference sums as ours do: FP8 on the CPU runs in float64 (ModelRunner), but the hybrid models keep the
    # recurrent state, the conv and the norms in float32 whatever the activations' dtype
    dtype = torch.float64 if kind == "llama" else torch.float32
    if kind == "llama":
        src, _ = request.getfixturevalue("llama_fp8")
    elif kind == "qwen3-next":
        src = request.getfixturevalue("hybrid_folder")
    else:
        src = request.getfixturevalue("qwen3_5_moe_saved" if kind == "qwen3.5-moe" else "qwen3_5_saved")[0]
    dst = tmp_path_factory.mktemp(kind) / "fp8"
    tensors = write_fp8(src, dst, block)
    if kind.startswith("qwen3.5"):
        import transformers as tf

        cls = tf.Qwen3_5MoeForConditionalGeneration if kind == "qwen3.5-moe" else tf.Qwen3_5ForConditionalGeneration
        hf = cls.from_pretrained(str(src), dtype=dtype).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype).eval()
    return dst, w8a8_reference(hf, tensors, block), block


@pytest.fixture(scope="module", params=["llama", "qwen3-next", "qwen3.5", "qwen3.5-moe"])
def fp8_checkpoint(request, tmp_path_factory):
    dst, hf, block = _checkpoint(request, tmp_path_factory, request.param)
    return request.param, dst, hf, make_engine(dst)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].double()


def test_published_layout_loads_fp8(fp8_checkpoint):
    kind, folder, _, engine = fp8_checkpoint
    cfg = load_config(resolve(str(folder)))
    assert cfg.quantization == "fp8" and cfg.quant_block == [32, 32]
    w = load_weights(resolve(str(folder)), torch.float32, "cpu", cfg)
    quantized = [k for k, v in w.items() if isinstance(v, fp8.Fp8Weight)]
    assert quantized and all(k.endswith(tuple(p + ".weight" for p in PUBLISHED)) for k in quantized)
    assert not isinstance(w["lm_head.weight"], fp8.Fp8Weight)
    if kind == "qwen3.5":  # in_proj_a/b stay 16-bit: the fused in_proj is FP8 rows, then plain rows
        assert isinstance(engine.runner.model.w["model.layers.0.linear_attn.in_proj.weight"], fp8.RowParts)


def test_fp8_logits_and_greedy_tokens_equal_the_w8a8_reference(fp8_checkpoint):
    _, _, hf, engine = fp8_checkpoint
    ids = prompt(11, 60)
    from tests.hybrid.conftest import chunked_logits

    ref = hf_logits(hf, ids)
    if engine.runner.state is not None:
        ours = chunked_logits(engine, ids, [0, 23, 60])
    else:
        from tests.common.test_model_vs_hf import full_logits

        ours = full_logits(engine.runner.model, ids, torch.float64)
    # sums in another order can move an activation across an e4m3 rounding point: a few thousandths at most
    assert (ours - ref).abs().max().item() <= 2e-3 * ref.abs().max().item()
    want, seq = [], list(ids)
    for _ in range(12):
        tok = int(hf_logits(hf, seq)[-1].argmax())
        want.append(tok)
        seq.append(tok)
    out = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.output_ids == want


def test_quantization_at_load_equals_the_converted_checkpoint(llama_fp8, tmp_path):
    src, _ = llama_fp8
    write_fp8(src, tmp_path / "fp8", (128, 128))
    a = make_engine(src, quantization="fp8")
    b = make_engine(tmp_path / "fp8")
    assert a.runner.quantization == b.runner.quantization == "fp8"
    ids = prompt(4, 30)
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert a.generate([ids], p)[0].output_ids == b.generate([ids], p)[0].output_ids
    plain = make_engine(src)
    assert plain.runner.quantization == "" and not any(
        isinstance(v, fp8.Fp8Weight) for v in plain.runner.model.w.values()
    )


@pytest.mark.parametrize("shape", ["tiny-test-fp8", "tiny-hybrid-fp8"])
def test_random_fp8_shapes_convert_at_load(shape):
    engine = make_engine(f"random:{shape}")
    assert engine.runner.quantization == "fp8"
    out = engine.generate([prompt(2, 20)], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert len(out.output_ids) == 6


# ---- refusals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "qc, match",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "'static'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size None"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
    ],
)
def test_other_quantization_configs_are_refused_naming_the_key(llama_fp8, tmp_path, qc, match):
    src, _ = llama_fp8
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ModelError, match=match):
        load_config(resolve(str(tmp_path / "m")))


def _rewrite(folder, edit):
    from safetensors.torch import load_file, save_file

    t = load_file(str(folder / "model.safetensors"))
    edit(t)
    save_file(t, str(folder / "model.safetensors"))


@pytest.mark.parametrize("damage", ["shape", "missing", "orphan", "dtype"])
def test_malformed_scales_are_refused_naming_the_tensor(llama_fp8, tmp_path, damage):
    src, _ = llama_fp8
    folder = tmp_path / "fp8"
    write_fp8(src, folder, (32, 32))
    name = "model.layers.1.mlp.down_proj.weight"

    def edit(t):
        if damage == "shape":
            t[name + "_scale_inv"] = t[name + "_scale_inv"][:, :1].contiguous()
        elif damage == "missing":
            del t[name + "_scale_inv"]
        elif damage == "orphan":
            t["model.layers.1.mlp.extra.weight_scale_inv"] = torch.ones(1, 1)
        else:
            t[name] = t[name].float()

    _rewrite(folder, edit)
    src_ = resolve(str(folder))
    what = "model.layers.1.mlp.extra.weight" if damage == "orphan" else name
    with pytest.raises(ModelError, match=what.replace(".", r"\.")):
        load_weights(src_, torch.float32, "cpu", load_config(src_))


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_fp8_experts_in_the_fused_moe_kernels_equal_the_loop(block):
    """random:tiny-hybrid with FP8 experts (and shared expert, folded into the stack as expert E) through
    kernels.moe's W8A8 grouped GEMMs (Triton's interpreter here) against the per-expert loop over fp8.linear: the
    same MoE layer outputs within float tolerance; a column block the kernels cannot take keeps the loop."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    from backends.common.core.config import SHAPES
    from backends.common.model.hybrid_model import HybridModel

    cfg = SHAPES["tiny-hybrid"]
    models = []
    for kernels in (False, True):
        w = loader.random_hybrid_weights(cfg, torch.float32, "cpu", seed=4)
        assert fp8.quantize_weights(w, block) > 0
        models.append(HybridModel(cfg, w, kernels=kernels))
    loop, fused = models
    assert loop.k_moe is None and fused.k_moe is not None and fused.fold_shared is False
    assert isinstance(fused.experts[1][0], fp8.Fp8Weight)
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    p = "model.layers.1.mlp."
    want = loop.mlp(x, p, 1)
    got = fused.mlp(x, p, 1)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (got - want).abs().max()
    w = loader.random_hybrid_weights(cfg, torch.float32, "cpu", seed=4)
    fp8.quantize_weights(w, (32, 24))  # a column block of 24: not a multiple of the FP8 tensor cores' 32
    assert HybridModel(cfg, w, kernels=True).k_moe is None
